//! A bucket told it serves another limit: the key's limit changed, or the key moved tiers.

use crate::limit::Limit;
use crate::quota::Name;

use super::{LocalBucket, NO_ANSWER};

impl LocalBucket {
    /// Tells the bucket which limit it serves: its `name` and `shape` (a hash of its name and
    /// shape). When the shape changed (a limit was raised or lowered), what the bucket knew of
    /// the global bucket no longer holds: it forgets that the key was throttled. When the name
    /// changed (the key moved to another tier), the lease holds another global bucket's tokens,
    /// which this limit may not use: they are taken out, reserved ones too, and returned as
    /// forfeited; what it owed that bucket for credit is returned as uncharged. Tokens it
    /// reserved ahead of the old limit's refill fall due by `limit`'s (now `now`) at the latest:
    /// the store keeps its debt in tokens and pays it back at the new rate, so a raised limit
    /// is not held back by reservations made under the old one.
    pub(crate) fn reshape(&mut self, name: Name, shape: u32, limit: &Limit, now: u64) -> Reshaped {
        let cold = self.cold();
        if cold.shape == shape && cold.dispenser == name.id() {
            return Reshaped::default();
        }
        let moved = !self.holds_tokens_of(name);
        let mut reshaped = Reshaped::default();
        if moved {
            self.low_water = 0;
            reshaped.forfeited = self.take_all_leased();
        }
        let cold = self.cold_mut();
        cold.reserved
            .hasten(now, |tokens| limit.micros_to_accrue(now, tokens));
        if moved {
            cold.global_left = NO_ANSWER;
            cold.quiet_at = 0;
            reshaped.uncharged = u64::from(std::mem::take(&mut cold.owed));
        }
        cold.shape = shape;
        cold.next_token_at = 0;
        cold.dispenser = name.id();
        reshaped
    }
}

/// What a bucket gave up when told it serves another limit (see [`LocalBucket::reshape`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reshaped {
    /// Leased tokens of the global bucket the key left.
    pub(crate) forfeited: u64,
    /// Tokens admitted on credit that bucket never took.
    pub(crate) uncharged: u64,
}

//! A host's own bucket for a key while the global store is unavailable.

use crate::bucket::{BucketLevel, TokenBucket};
use crate::clock::micros;
use crate::limit::Limit;

use super::View;

/// A host's own bucket for a key while the global store is unavailable.
pub(super) struct Fallback {
    /// The host's share of the limit that the bucket follows.
    pub(super) share: Limit,
    pub(super) bucket: TokenBucket,
}

impl Fallback {
    /// Whether it is full at `now`: from then on it is the same as no bucket, which starts full.
    pub(super) fn is_full_at(&self, now: u64) -> bool {
        self.bucket.is_full_at(&self.share, now)
    }

    /// The limit or the expected fleet changed: a bucket of the new `share`, holding what the
    /// old one held at `now` (at most the new capacity).
    pub(super) fn reshare(&mut self, share: &Limit, now: u64) {
        let mut old = self.bucket;
        old.refill(&self.share, now);
        let lacking = share.capacity().saturating_sub(old.tokens());
        self.share = *share;
        self.bucket = TokenBucket::full(share, now);
        self.bucket.take(share, now, lacking, lacking);
    }

    /// What this host can admit alone, as its share tells it: `lease` tokens leased before the
    /// store went down and this bucket's, within the share's capacity (a view says no more
    /// tokens than its limit holds; the lease beyond it is still admitted from).
    pub(super) fn view(&self, lease: u64, now: u64) -> View {
        let level = BucketLevel::of(&self.bucket, &self.share, now);
        let tokens = lease
            .saturating_add(level.tokens)
            .min(self.share.capacity());
        View {
            tokens,
            next_in: micros(level.next_in),
            full_in: micros(level.full_in),
            share: Some(self.share),
        }
    }
}

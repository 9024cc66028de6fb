//! Changes made by hand to a key's global buckets (an operator's reset, drain, grant or
//! charge), and how the hosts learn of them: this one at once, the others at their next call
//! to the store, within a lease time-to-live even for a key they are refusing.

use crate::clock::{Clock, micros};
use crate::error::StoreError;
use crate::global::Adjustment;
use crate::quota::{BucketKey, LeaseKey};
use crate::remaining::Remaining;
use crate::throttle::{Global, Key, Local, Throttle};

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// How long (micros) a host trusts an answer that said a key is short before it asks
    /// again: the refusal memory, one lease time-to-live unless set, so that a reset reaches
    /// every host within it.
    pub(crate) fn recheck_after(&self) -> u64 {
        micros(self.config.refusal_memory.unwrap_or(self.config.lease_ttl))
    }

    /// Applies `adjustment` to every global bucket of `key` at `level`, then to this host's
    /// leases of them: each learns its bucket's level after, as from an answer; a drain also
    /// revokes the tokens it held (counted as forfeited). Returns each limit's level after; a
    /// change the store dropped as too late for its window ends it there, as an error does.
    pub(crate) async fn adjust(
        &self,
        level: u8,
        key: &K,
        adjustment: Adjustment,
    ) -> Result<Vec<Remaining>, StoreError<G::Error>> {
        let Some((level_name, quota)) = self.level_quota(level, key) else {
            return Ok(Vec::new());
        };
        // A drain stops the key at once; a removal charges tokens and leaves the lease.
        let revoke = matches!(adjustment, Adjustment::Drain);
        let mut out = Vec::with_capacity(quota.len());
        for (slot, (name, limit)) in (0..).zip(quota.slots_iter()) {
            let bucket = BucketKey::from_parts(key.clone(), self.config.layer, level_name, name);
            // A calendar quota's change is for the window it is made in: a store that applies
            // it after the reset (one that stalled with it) drops it.
            let sent_at = self.now();
            let expires = limit.window_expiry(sent_at);
            let adjusted = self
                .operator_call(self.global.adjust(&bucket, &limit, adjustment, expires))
                .await?;
            let after = adjusted.level;
            // A dropped drain took nothing from the bucket: the lease keeps its tokens.
            let revoke = revoke && adjusted.applied;
            let id = LeaseKey::new(key.clone(), level, slot);
            let now = self.now();
            // The answer is the bucket's under the limit it was asked with: if the key's limit
            // changed (or moved to another tier) while the call was under way, its times are
            // not this limit's, and the lease learns the bucket at its next answer; a drain
            // still takes out what the lease holds of that bucket.
            let current = self.resolve(&id);
            let unchanged = current.is_some_and(|c| c.name == name && c.limit == limit);
            let revoked = self.local.with_bucket(&id, |b| match unchanged {
                true => b.adjusted(revoke, &after, sent_at, now),
                false if revoke && b.holds_tokens_of(name) => b.take_all_leased(),
                false => 0,
            });
            self.stats.tokens_forfeited.add(revoked);
            if !adjusted.applied {
                return Err(StoreError::WindowEnded);
            }
            out.push(self.remaining_global_of(key, name, level_name, limit, after));
        }
        Ok(out)
    }

    /// An operator's call to the store, within the store time-out. Boxed: a store's future
    /// (Redis's is deep) inside the time-out's, inside the caller's, would otherwise nest past
    /// the compiler's default depth in an application's own async code.
    pub(crate) async fn operator_call<T>(
        &self,
        call: impl Future<Output = Result<T, G::Error>>,
    ) -> Result<T, StoreError<G::Error>> {
        let timeout = self.config.store_timeout;
        match tokio::time::timeout(timeout, Box::pin(call)).await {
            Ok(answer) => answer.map_err(StoreError::Store),
            Err(_) => Err(StoreError::TimedOut(timeout)),
        }
    }
}

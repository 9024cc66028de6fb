//! Concurrency slots on Redis: one hash per key, set by one script on Redis's clock.

use redis::RedisError;

use crate::clock::micros;
use crate::global::redis::{RedisGlobalStore, RedisKey};
use crate::global::slots::{Holding, SlotHold, SlotStore};
use crate::quota::BucketKey;

/// What each host holds of a key's slots lives in the hash at the key's
/// [`redis_key`](RedisGlobalStore::redis_key) followed by `:slots` (no bucket's key ends so:
/// names hold no `:`), as `host -> "held seq expires_at"`; the hash expires with its last
/// holding.
impl<K> SlotStore<BucketKey<K>> for RedisGlobalStore<K>
where
    K: RedisKey + Send + Sync + 'static,
{
    type Error = RedisError;

    async fn hold(
        &self,
        key: &BucketKey<K>,
        max: u64,
        hold: SlotHold,
    ) -> Result<Holding, RedisError> {
        let mut redis_key = self.redis_key(key);
        redis_key.extend_from_slice(b":slots");
        let ttl = micros(hold.ttl).max(1);
        let (held, others): (u64, u64) = self
            .eval(&self.scripts.slots, |cmd| {
                cmd.arg(1)
                    .arg(&redis_key)
                    .arg(max)
                    .arg(hold.host)
                    .arg(hold.seq)
                    .arg(hold.want)
                    .arg(ttl);
            })
            .await?;
        Ok(Holding { held, others })
    }
}

//! Concurrency slots on Redis: one hash per key, set by one script on Redis's clock.

use futures_util::stream::{self, FuturesUnordered, Stream, StreamExt};
use redis::RedisError;

use crate::clock::micros;
use crate::global::redis::{RedisGlobalStore, RedisKey};
use crate::global::slots::{Holding, SlotHold, SlotStore};
use crate::quota::BucketKey;

/// The script over many keys: slots.lua wrapped as a function (its parameters shadow the
/// script's `KEYS` and `ARGV`), and the loop over the keys, at one time for all.
pub(super) const SLOTS_MANY: &str = concat!(
    "local function hold(KEYS, ARGV)\n",
    include_str!("slots.lua"),
    "\nend\n",
    include_str!("slots_many.lua"),
);

/// The holds of one script: their indexes in the batch, and the script's keys and arguments.
#[derive(Default)]
struct Group {
    indexes: Vec<usize>,
    keys: Vec<Vec<u8>>,
    args: Vec<u64>,
}

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
        let redis_key = self.slots_key(key);
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

    /// One script per node (on a Cluster, per hash tag, all at once), each answered as it
    /// comes.
    fn hold_many(
        &self,
        holds: Vec<(BucketKey<K>, u64, SlotHold)>,
    ) -> impl Stream<Item = (usize, Result<Holding, RedisError>)> + Send {
        self.slot_groups(holds)
            .into_iter()
            .map(|group| async move {
                let replies: Result<Vec<(i64, i64)>, RedisError> = self
                    .eval(&self.scripts.slots_many, |cmd| {
                        cmd.arg(group.keys.len()).arg(&group.keys).arg(&group.args);
                    })
                    .await;
                holdings(group.indexes, replies)
            })
            .collect::<FuturesUnordered<_>>()
            .flat_map(stream::iter)
    }
}

impl<K: RedisKey + Send + Sync + 'static> RedisGlobalStore<K> {
    /// The hash of `key`'s slot holdings.
    fn slots_key(&self, key: &BucketKey<K>) -> Vec<u8> {
        let mut redis_key = self.redis_key(key);
        redis_key.extend_from_slice(b":slots");
        redis_key
    }

    /// The holds by script: all in one on a single node; on a Cluster, by hash tag (the keys
    /// of one script must share a slot).
    fn slot_groups(&self, holds: Vec<(BucketKey<K>, u64, SlotHold)>) -> Vec<Group> {
        let mut groups: Vec<(Vec<u8>, Group)> = Vec::new();
        for (i, (key, max, hold)) in holds.into_iter().enumerate() {
            let redis_key = self.slots_key(&key);
            let group: &mut Group = self.group_of(&mut groups, &redis_key);
            group.indexes.push(i);
            group.keys.push(redis_key);
            let ttl = micros(hold.ttl).max(1);
            group
                .args
                .extend([max, hold.host, hold.seq, hold.want, ttl]);
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }
}

/// Each hold of a script with its reply, or the script's error.
fn holdings(
    indexes: Vec<usize>,
    replies: Result<Vec<(i64, i64)>, RedisError>,
) -> Vec<(usize, Result<Holding, RedisError>)> {
    match replies {
        Ok(replies) if replies.len() == indexes.len() => indexes
            .into_iter()
            .zip(replies)
            .map(|(i, reply)| (i, holding(reply)))
            .collect(),
        Ok(replies) => {
            let error = RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "a reply per key",
                format!("{} replies to {} keys", replies.len(), indexes.len()),
            ));
            indexes
                .into_iter()
                .map(|i| (i, Err(error.clone())))
                .collect()
        }
        Err(error) => indexes
            .into_iter()
            .map(|i| (i, Err(error.clone())))
            .collect(),
    }
}

/// One key's reply as its holding, or its failure (-1 held: a command on its hash failed).
fn holding((held, others): (i64, i64)) -> Result<Holding, RedisError> {
    match (u64::try_from(held), u64::try_from(others)) {
        (Ok(held), Ok(others)) => Ok(Holding { held, others }),
        _ => Err(super::failed_in_script()),
    }
}

//! Many calls in one round trip: one script over all the buckets of a node (on a Cluster, one
//! per hash slot's tag, all at once), each bucket answered on its own.

use futures_util::stream::{self, FuturesUnordered, Stream, StreamExt};
use redis::{ErrorKind, RedisError};

use super::{RedisGlobalStore, RedisKey};
use crate::clock::micros;
use crate::global::{Answer, Call, Grant};
use crate::quota::BucketKey;

/// The script: the bucket arithmetic, defined once, with an acquire and a release function
/// around it (their parameters shadow the script's `KEYS` and `ARGV`), and the loop over the
/// buckets, which reads Redis's time once for all.
pub(super) const MANY: &str = concat!(
    include_str!("bucket.lua"),
    "local function acquire(KEYS, ARGV, redis_now)\nload(KEYS, ARGV, redis_now)\n",
    include_str!("acquire.lua"),
    "\nend\nlocal function release(KEYS, ARGV, redis_now)\nload(KEYS, ARGV, redis_now)\n",
    include_str!("release.lua"),
    "\nend\n",
    include_str!("many.lua"),
);

/// The calls of one script: their indexes in the batch, whether each acquires, and the
/// script's keys and arguments.
#[derive(Default)]
struct Group {
    indexes: Vec<usize>,
    acquires: Vec<bool>,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl<K: RedisKey + Send + Sync + 'static> RedisGlobalStore<K> {
    /// Answers `calls` as their scripts answer.
    pub(super) fn run_batch(
        &self,
        calls: Vec<Call<BucketKey<K>>>,
    ) -> impl Stream<Item = (usize, Result<Answer, RedisError>)> + Send + '_ {
        self.groups(calls)
            .into_iter()
            .map(|group| async move {
                let replies = self.run_group(&group).await;
                answers(group, replies)
            })
            .collect::<FuturesUnordered<_>>()
            .flat_map(stream::iter)
    }

    /// The calls by script: all in one on a single node; on a Cluster, by hash tag (the keys
    /// of one script must share a slot).
    fn groups(&self, calls: Vec<Call<BucketKey<K>>>) -> Vec<Group> {
        let mut groups: Vec<(Vec<u8>, Group)> = Vec::new();
        for (i, call) in calls.into_iter().enumerate() {
            let (key, limit, op, args) = match call {
                Call::Acquire {
                    key,
                    limit,
                    request,
                } => (
                    key,
                    limit,
                    "a",
                    [request.min, request.want, micros(request.max_delay)],
                ),
                Call::Release { key, limit, back } => {
                    (key, limit, "r", [back.tokens, back.expires_micros(), 0])
                }
            };
            let redis_key = self.redis_key(&key);
            let group = self.group_of(&mut groups, &redis_key);
            group.indexes.push(i);
            group.acquires.push(op == "a");
            group.keys.push(redis_key);
            group.args.push(op.as_bytes().to_vec());
            let numbers = [
                limit.capacity(),
                limit.refill_amount(),
                limit.period_micros(),
                limit.cold_max(),
                u64::from(super::calendar_code(&limit)),
            ];
            for n in numbers {
                group.args.push(n.to_string().into_bytes());
            }
            let shift = self.calendar_shift(&limit);
            group
                .args
                .push(shift.map_or_else(|| b"0".to_vec(), String::into_bytes));
            for n in args {
                group.args.push(n.to_string().into_bytes());
            }
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }

    /// The group of the script `redis_key` goes in, added if it is the first of its script:
    /// on a single node there is one; on a Cluster, one per hash tag.
    pub(super) fn group_of<'a, G: Default>(
        &self,
        groups: &'a mut Vec<(Vec<u8>, G)>,
        redis_key: &[u8],
    ) -> &'a mut G {
        let tag = match self.is_cluster() {
            true => hash_tag(redis_key),
            false => &[],
        };
        let at = match groups.iter().position(|(t, _)| t.as_slice() == tag) {
            Some(at) => at,
            None => {
                groups.push((tag.to_vec(), G::default()));
                groups.len() - 1
            }
        };
        &mut groups[at].1
    }

    /// Runs one group's script: `EVALSHA`, and `EVAL` when the node does not know it.
    async fn run_group(&self, group: &Group) -> Result<Vec<Vec<u64>>, RedisError> {
        self.eval(&self.scripts.many, |cmd| {
            cmd.arg(group.keys.len()).arg(&group.keys).arg(&group.args);
        })
        .await
    }
}

/// Each call of `group` with its reply, or the script's error.
fn answers(
    group: Group,
    replies: Result<Vec<Vec<u64>>, RedisError>,
) -> Vec<(usize, Result<Answer, RedisError>)> {
    let mut replies = match replies {
        Ok(replies) => replies.into_iter().map(Some).collect(),
        Err(error) => {
            return group
                .indexes
                .into_iter()
                .map(|i| (i, Err(error.clone())))
                .collect();
        }
    };
    let replies: &mut Vec<Option<Vec<u64>>> = &mut replies;
    group
        .indexes
        .into_iter()
        .zip(group.acquires)
        .enumerate()
        .map(|(n, (i, acquire))| {
            let reply = replies.get_mut(n).and_then(Option::take);
            (i, answer(acquire, reply))
        })
        .collect()
}

/// One bucket's reply as its call's answer.
fn answer(acquire: bool, reply: Option<Vec<u64>>) -> Result<Answer, RedisError> {
    match (acquire, reply.as_deref()) {
        (true, Some(&[granted, reserved, ready_in, remaining, refill_in])) => {
            Ok(Answer::Granted(Grant {
                granted,
                reserved,
                ready_in: std::time::Duration::from_micros(ready_in),
                remaining,
                refill_in: std::time::Duration::from_micros(refill_in),
            }))
        }
        (false, Some(&[_held])) => Ok(Answer::Released),
        _ => Err(RedisError::from((
            ErrorKind::UnexpectedReturnType,
            "a batch script's reply does not match its call",
        ))),
    }
}

/// What decides a Redis key's Cluster slot: the text between its first `{` and the next `}`
/// when that is not empty, else the whole key.
fn hash_tag(key: &[u8]) -> &[u8] {
    let Some(open) = key.iter().position(|&b| b == b'{') else {
        return key;
    };
    match key[open + 1..].iter().position(|&b| b == b'}') {
        Some(0) | None => key,
        Some(len) => &key[open + 1..open + 1 + len],
    }
}

#[cfg(test)]
mod tests {
    use super::hash_tag;

    #[test]
    fn the_hash_tag_follows_redis_rules() {
        assert_eq!(hash_tag(b"ht:{k1}:default"), b"k1");
        assert_eq!(hash_tag(b"ht:{}:x{y}"), b"ht:{}:x{y}");
        assert_eq!(hash_tag(b"plain"), b"plain");
        assert_eq!(hash_tag(b"a{b"), b"a{b");
    }
}

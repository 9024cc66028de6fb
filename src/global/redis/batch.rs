//! Many calls in one round trip: one script over all the buckets of a node (on a Cluster, one
//! per hash slot's tag, all at once), each bucket answered on its own.

use futures_util::stream::{self, FuturesUnordered, Stream, StreamExt};
use redis::{ErrorKind, RedisError};

use super::{RedisGlobalStore, RedisKey};
use crate::clock::micros;
use crate::global::{Answer, Call, Grant};
use crate::limit::Limit;
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

/// The calls of one script: their indexes in the batch, the script's keys, each bucket's
/// arguments, and the limits they name (each written once per script, however many buckets
/// share it).
#[derive(Default)]
struct Group {
    indexes: Vec<usize>,
    keys: Vec<Vec<u8>>,
    buckets: Vec<BucketArgs>,
    limits: Vec<ScriptLimit>,
}

/// A limit as a script reads it, with a calendar quota's resets' distance from midnight UTC,
/// read when the call was grouped.
#[derive(PartialEq)]
struct ScriptLimit {
    limit: Limit,
    shift: Option<String>,
}

impl Group {
    /// The number `many.lua` knows `limit` by in this script (from 1), added if new.
    fn limit_number(&mut self, limit: ScriptLimit) -> usize {
        let at = match self.limits.iter().position(|known| *known == limit) {
            Some(at) => at,
            None => {
                self.limits.push(limit);
                self.limits.len() - 1
            }
        };
        at + 1
    }
}

/// One bucket's arguments, in the order `many.lua` reads them, kept as numbers until they are
/// written into the command (no text made per argument).
struct BucketArgs {
    acquire: bool,
    /// Its limit's number among the script's limits.
    limit: usize,
    /// The operation's own three arguments.
    op: [u64; 3],
}

impl BucketArgs {
    /// The bucket's five arguments.
    fn write(&self, cmd: &mut redis::Cmd) {
        cmd.arg(if self.acquire { "a" } else { "r" })
            .arg(self.limit)
            .arg(&self.op[..]);
    }

    /// How many numbers the script replies for this bucket.
    fn reply_len(&self) -> usize {
        if self.acquire { 5 } else { 1 }
    }
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
            let (key, limit, acquire, op) = match call {
                Call::Acquire {
                    key,
                    limit,
                    request,
                } => (
                    key,
                    limit,
                    true,
                    [request.min, request.want, micros(request.max_delay)],
                ),
                Call::Release { key, limit, back } => {
                    (key, limit, false, [back.tokens, back.expires_micros(), 0])
                }
            };
            let redis_key = self.redis_key(&key);
            let shift = self.calendar_shift(&limit);
            let group = self.group_of(&mut groups, &redis_key);
            group.indexes.push(i);
            group.keys.push(redis_key);
            let limit = group.limit_number(ScriptLimit { limit, shift });
            group.buckets.push(BucketArgs { acquire, limit, op });
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

    /// Runs one group's script: `EVALSHA`, and `EVAL` when the node does not know it. The
    /// replies of all its buckets come as one list of numbers.
    async fn run_group(&self, group: &Group) -> Result<Vec<i64>, RedisError> {
        self.eval(&self.scripts.many, |cmd| {
            cmd.arg(group.keys.len()).arg(&group.keys);
            for bucket in &group.buckets {
                bucket.write(cmd);
            }
            cmd.arg(group.limits.len());
            for ScriptLimit { limit, shift } in &group.limits {
                super::write_limit(cmd, limit, shift.as_deref());
            }
        })
        .await
    }
}

/// Each call of `group` with its reply (its numbers, taken in turn from the script's list), or
/// the script's error.
fn answers(
    group: Group,
    replies: Result<Vec<i64>, RedisError>,
) -> Vec<(usize, Result<Answer, RedisError>)> {
    let replies = match replies {
        Ok(replies) => replies,
        Err(error) => {
            return group
                .indexes
                .into_iter()
                .map(|i| (i, Err(error.clone())))
                .collect();
        }
    };
    let mut next = 0;
    group
        .indexes
        .into_iter()
        .zip(&group.buckets)
        .map(|(i, bucket)| {
            let end = next + bucket.reply_len();
            let reply = replies.get(next..end);
            next = end;
            (i, answer(bucket.acquire, reply))
        })
        .collect()
}

/// One bucket's reply as its call's answer: its numbers, or -1 first where its command failed.
fn answer(acquire: bool, reply: Option<&[i64]>) -> Result<Answer, RedisError> {
    let number = |n: i64| u64::try_from(n).ok();
    match (acquire, reply) {
        (_, Some(&[failed, ..])) if failed < 0 => Err(super::failed_in_script()),
        (true, Some(&[granted, reserved, ready_in, remaining, refill_in])) => {
            match [granted, reserved, ready_in, remaining, refill_in].map(number) {
                [
                    Some(granted),
                    Some(reserved),
                    Some(ready_in),
                    Some(remaining),
                    Some(refill_in),
                ] => Ok(Answer::Granted(Grant {
                    granted,
                    reserved,
                    ready_in: std::time::Duration::from_micros(ready_in),
                    remaining,
                    refill_in: std::time::Duration::from_micros(refill_in),
                })),
                _ => Err(mismatch()),
            }
        }
        (false, Some(&[_held])) => Ok(Answer::Released),
        _ => Err(mismatch()),
    }
}

fn mismatch() -> RedisError {
    RedisError::from((
        ErrorKind::UnexpectedReturnType,
        "a batch script's reply does not match its call",
    ))
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
    use super::{Answer, BucketArgs, Group, ScriptLimit, answers, hash_tag};

    fn bucket(acquire: bool) -> BucketArgs {
        BucketArgs {
            acquire,
            limit: 1,
            op: [1, 1, 0],
        }
    }

    /// The replies come as one list: each bucket takes its own count of numbers in turn
    /// (five for an acquire, one for a release), and a list that runs short fails only the
    /// buckets it leaves without their numbers.
    #[test]
    fn each_bucket_reads_its_own_numbers_from_the_one_list() {
        let group = || Group {
            indexes: vec![7, 3, 9],
            keys: vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()],
            buckets: vec![bucket(true), bucket(false), bucket(true)],
            limits: Vec::new(),
        };
        let all = answers(group(), Ok(vec![1, 0, 0, 9, 0, 4, 0, 2, 5_000, 0, 100]));
        let indexes: Vec<usize> = all.iter().map(|(i, _)| *i).collect();
        assert_eq!(indexes, [7, 3, 9]);
        let granted = |answer: &Result<Answer, _>| match answer {
            Ok(Answer::Granted(grant)) => Some((grant.granted, grant.reserved, grant.remaining)),
            _ => None,
        };
        assert_eq!(granted(&all[0].1), Some((1, 0, 9)));
        assert!(matches!(all[1].1, Ok(Answer::Released)));
        assert_eq!(granted(&all[2].1), Some((0, 2, 0)));

        let short = answers(group(), Ok(vec![1, 0, 0, 9, 0, 4, 0, 2]));
        assert_eq!(granted(&short[0].1), Some((1, 0, 9)));
        assert!(matches!(short[1].1, Ok(Answer::Released)));
        assert!(short[2].1.is_err(), "a bucket without its numbers fails");

        // A bucket whose command failed in the script (-1 first) fails alone.
        let one_failed = answers(group(), Ok(vec![-1, 0, 0, 0, 0, 4, 0, 2, 5_000, 0, 100]));
        assert!(one_failed[0].1.is_err());
        assert!(matches!(one_failed[1].1, Ok(Answer::Released)));
        assert_eq!(granted(&one_failed[2].1), Some((0, 2, 0)));
        let release_failed = answers(group(), Ok(vec![1, 0, 0, 9, 0, -1, 0, 2, 5_000, 0, 100]));
        assert!(release_failed[1].1.is_err());
        assert_eq!(granted(&release_failed[2].1), Some((0, 2, 0)));
    }

    /// Buckets of one limit name it by one number; the same limit with another calendar
    /// shift (read on either side of a zone's change) is another.
    #[test]
    fn a_script_names_each_limit_once() {
        let (a, b) = (
            crate::Limit::per_second(1).burst(10).unwrap(),
            crate::Limit::per_minute(5).burst(5).unwrap(),
        );
        let limit = |limit, shift: Option<&str>| ScriptLimit {
            limit,
            shift: shift.map(str::to_owned),
        };
        let mut group = Group::default();
        let numbers = [
            group.limit_number(limit(a, None)),
            group.limit_number(limit(b, None)),
            group.limit_number(limit(a, None)),
            group.limit_number(limit(b, Some("3600000000"))),
            group.limit_number(limit(b, None)),
        ];
        assert_eq!(numbers, [1, 2, 1, 3, 2]);
        assert_eq!(group.limits.len(), 3);
    }

    #[test]
    fn the_hash_tag_follows_redis_rules() {
        assert_eq!(hash_tag(b"ht:{k1}:default"), b"k1");
        assert_eq!(hash_tag(b"ht:{}:x{y}"), b"ht:{}:x{y}");
        assert_eq!(hash_tag(b"plain"), b"plain");
        assert_eq!(hash_tag(b"a{b"), b"a{b");
    }
}

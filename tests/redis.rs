//! RedisGlobalStore against real redis-server processes that the tests start on free loopback
//! ports: the shared arithmetic suite, a fleet, skewed host clocks, a 3-primary cluster,
//! hostile keys, crashes and stalls of the server under each failure policy, and latency,
//! stalls and dropped connections through a fault proxy.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::proxy::FaultProxy;
use common::redis_server::{RedisCluster, RedisServer};
use common::*;
use hierarchical_throttle::clock::{Clock, ManualClock};
use hierarchical_throttle::global::redis::RedisGlobalStore;
use hierarchical_throttle::global::slots::SlotHold;
use hierarchical_throttle::global::{
    Adjustment, Answer, Call, GlobalStore, TokenRequest, TokenReturn,
};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{FailurePolicy, HierarchicalThrottleLayer, Limit, RejectionReason};
use redis::AsyncCommands;
use tower::{Layer, service_fn};

async fn store(server: &RedisServer) -> RedisGlobalStore<String> {
    RedisGlobalStore::connect(&server.url())
        .await
        .expect("connect to the test's redis-server")
}

/// `key`'s bucket of the limit called `default`.
fn bucket(key: &str) -> BucketKey<String> {
    BucketKey::new(key.to_owned(), "default").unwrap()
}

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(server.url()).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

#[tokio::test]
async fn redis_passes_the_same_conformance_suite_as_memory() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000_000));
    let redis = store(&server).await.with_clock_override(clock.clone());
    hierarchical_throttle::global::conformance::assert_conformance(&redis, &clock).await;
}

/// A bucket's progress towards its next token is stored in units of its limit's period, which
/// the bucket does not keep: after a change to a limit of a shorter period it counts for less
/// than one token, never for millions (23 hours of a day's token read as 10 ms ones).
#[tokio::test]
async fn a_share_of_a_token_counts_for_less_than_one_token_under_a_changed_limit() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000_000));
    let redis = store(&server).await.with_clock_override(clock.clone());
    let (daily, fast) = (
        Limit::per_day(1).burst(1).unwrap(),
        Limit::per_second(100).burst(100).unwrap(),
    );
    let key = bucket("changed");
    let grant = redis.acquire(&key, &daily, TokenRequest::now(1, 1)).await;
    assert_eq!(grant.unwrap().granted, 1);
    // 23 hours on, refused under the daily limit: 23/24 of a token stored.
    clock.advance(Duration::from_secs(23 * 3600));
    let grant = redis.acquire(&key, &daily, TokenRequest::now(1, 1)).await;
    assert_eq!(grant.unwrap().granted, 0);
    // At once under a limit of 10 ms tokens.
    let grant = redis.acquire(&key, &fast, TokenRequest::now(1, 100)).await;
    let grant = grant.unwrap();
    assert_eq!((grant.granted, grant.remaining), (0, 0));
    assert!(grant.refill_in <= Duration::from_millis(10), "{grant:?}");
    clock.advance(Duration::from_millis(10));
    let grant = redis.acquire(&key, &fast, TokenRequest::now(1, 100)).await;
    assert_eq!(grant.unwrap().granted, 1);
}

#[tokio::test]
async fn with_hashed_keys_redis_passes_the_suite_shares_buckets_and_never_holds_a_key() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000_000));
    let secret = [42; 16];
    let hashed = store(&server).await.with_hashed_keys(secret);
    hierarchical_throttle::global::conformance::assert_conformance(
        &hashed.clone().with_clock_override(clock.clone()),
        &clock,
    )
    .await;

    // Two hosts with the secret share one bucket of burst 3 for a key that is a secret.
    let api_key = "sk_live_4f3c2a1b";
    let hosts: Vec<_> = (0..2)
        .map(|_| {
            HierarchicalThrottleLayer::builder()
                .key(|k: &String| Some(k.clone()))
                .limit(Limit::per_hour(1).burst(3).unwrap())
                .cold_start(hierarchical_throttle::ColdStart::Exact)
                .failure_policy(FailurePolicy::Reject)
                .global_store(hashed.clone())
                .build()
                .unwrap()
        })
        .collect();
    let mut admitted = 0;
    for host in hosts.iter().cycle().take(6) {
        admitted += u64::from(host.acquire(api_key.to_owned(), 1).await.is_ok());
    }
    assert_eq!(admitted, 3, "one bucket for the fleet");

    let names = server.cli(&["keys", "*"]);
    let hashed_name = String::from_utf8(hashed.redis_key(&bucket(api_key))).unwrap();
    assert!(names.contains(&hashed_name), "{hashed_name} not in {names}");
    assert!(!names.contains("sk_live"), "a key written out: {names}");
    // The same key written out is another bucket, full.
    let plain = store(&server).await;
    let grant = plain
        .acquire(
            &bucket(api_key),
            &Limit::per_hour(1).burst(3).unwrap(),
            TokenRequest::now(3, 3),
        )
        .await
        .unwrap();
    assert_eq!(grant.granted, 3);
}

#[tokio::test]
async fn hand_backs_and_changes_expire_by_redis_s_own_clock() {
    let server = RedisServer::start();
    let redis = store(&server).await;
    let limit = Limit::per_day(10).burst(10).unwrap();
    let key = bucket("hand-backs");
    let unix_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let hour = Duration::from_secs(3_600);
    let grant = redis.acquire(&key, &limit, TokenRequest::now(10, 10)).await;
    assert_eq!(grant.unwrap().granted, 10);
    // Redis's `TIME` is within an hour of this host's clock: one hand-back expired, one not,
    // alone and in a batch.
    let expired = TokenReturn::expiring(4, unix_now - hour);
    let live = TokenReturn::expiring(3, unix_now + hour);
    redis.release(&key, &limit, expired).await.unwrap();
    redis.release(&key, &limit, live).await.unwrap();
    let calls = vec![
        Call::Release {
            key: key.clone(),
            limit,
            back: expired,
        },
        Call::Release {
            key: key.clone(),
            limit,
            back: live,
        },
    ];
    let answers: Vec<_> = futures_util::StreamExt::collect(redis.call_many(calls)).await;
    assert!(
        answers
            .iter()
            .all(|(_, a)| matches!(a, Ok(Answer::Released)))
    );
    let level = redis.level(&key, &limit).await.unwrap();
    assert_eq!(
        level.tokens, 6,
        "the live tokens twice, the expired ones never"
    );
    // An operator's change likewise.
    let add = Adjustment::Add(2);
    let dropped = redis.adjust(&key, &limit, add, Some(unix_now - hour)).await;
    let dropped = dropped.unwrap();
    assert_eq!(
        (dropped.level.tokens, dropped.applied),
        (6, false),
        "an expired change is dropped, and said so"
    );
    let live = redis.adjust(&key, &limit, add, Some(unix_now + hour)).await;
    let live = live.unwrap();
    assert_eq!(
        (live.level.tokens, live.applied),
        (8, true),
        "a live one applies"
    );
}

#[tokio::test]
async fn buckets_expire_when_they_would_be_full_again() {
    let server = RedisServer::start();
    let redis = store(&server).await;
    let limit = Limit::per_second(10).burst(10).unwrap();
    let key = bucket("expiring");
    let grant = redis
        .acquire(&key, &limit, TokenRequest::now(3, 3))
        .await
        .unwrap();
    assert_eq!(grant.granted, 3);
    let mut conn = raw(&server).await;
    let redis_key = redis.redis_key(&key);
    let ttl: i64 = conn.pttl(&redis_key).await.unwrap();
    // 3 tokens at 10 per second: full again in 300 ms (less the time since the call).
    assert!((200..=300).contains(&ttl), "pttl {ttl}");
    // One string: whole tokens, the remainder, the time updated (Redis's, in us).
    let value: String = conn.get(&redis_key).await.unwrap();
    let fields: Vec<u64> = value.split(' ').map(|f| f.parse().unwrap()).collect();
    assert_eq!(fields[..2], [7, 0], "{value}");
    assert_eq!(fields.len(), 3, "{value}");
    redis
        .release(&key, &limit, TokenReturn::new(3))
        .await
        .unwrap();
    let exists: bool = conn.exists(&redis_key).await.unwrap();
    assert!(
        !exists,
        "a full bucket is deleted: it is the same as a new one"
    );
    // With a warm-up, a bucket is the same as a new one once it is full and cold again: one
    // permit from a cold bucket of 10 per second warming up over 2 s costs 2.9 tokens (290 ms
    // to refill) and a cold permit (100 ms to store again).
    let warm = limit.warm_up(Duration::from_secs(2)).unwrap();
    let key = bucket("expiring-warm");
    let grant = redis.acquire(&key, &warm, TokenRequest::now(1, 1)).await;
    assert_eq!(grant.unwrap().granted, 1);
    let redis_key = redis.redis_key(&key);
    let ttl: i64 = conn.pttl(&redis_key).await.unwrap();
    assert!((370..=390).contains(&ttl), "pttl {ttl}");
    let value: String = conn.get(&redis_key).await.unwrap();
    assert_eq!(
        value.split(' ').count(),
        4,
        "a warm-up's bucket keeps its cold permits too: {value}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn four_hosts_on_one_redis_hold_the_limit_with_few_redis_calls() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = store(&server).await.with_clock_override(clock.clone());
    let limit = Limit::per_second(100).burst(200).unwrap();
    // Uneven load at about 1.5x the limit: host 0 every 5 ms, host i > 0 every 10 * (i + 1) ms.
    let run = run_fleet(&clock, redis, limit, 60, |i, ms| {
        ms % (10 * (i as u64 + 1)) == 0 || (i == 0 && ms % 5 == 0)
    })
    .await;
    println!(
        "redis fleet: {run:?}: {:.1} redis calls per 1000 requests",
        1000.0 * run.global_calls as f64 / run.requests as f64
    );
    run.assert_holds_the_limit();
    assert!(
        run.global_calls * 4 < run.requests,
        "redis calls are not a small fraction"
    );
}

/// Credit (the default) on a real Redis: hosts that know nothing of an exhausted key admit one
/// request each at once, and the charge behind it puts the Redis bucket into debt, which every
/// host then waits out.
#[tokio::test(flavor = "current_thread")]
async fn credit_on_redis_is_charged_into_debt_and_bounded_by_the_hosts() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = store(&server).await.with_clock_override(clock.clone());
    // 10 a second, burst 10; the clock stands still.
    let limit = Limit::per_second(10).burst(10).unwrap();
    let hosts: Vec<_> = (0..4)
        .map(|_| {
            HierarchicalThrottleLayer::builder()
                .key(|k: &String| Some(k.clone()))
                .limit(limit)
                .clock(clock.clone())
                .failure_policy(FailurePolicy::Reject)
                .global_store(redis.clone())
                .build()
                .unwrap()
        })
        .collect();
    let mut admitted = 0;
    for _ in 0..10 {
        admitted += u64::from(hosts[0].acquire("k".to_owned(), 1).await.is_ok());
    }
    for host in &hosts[1..] {
        admitted += u64::from(host.acquire("k".to_owned(), 1).await.is_ok());
    }
    assert_eq!(
        admitted, 13,
        "the burst, and a credit of one token per other host"
    );
    // The charges run behind the responses: wait (a bounded poll) until Redis holds the debt.
    let deadline = Instant::now() + Duration::from_secs(5);
    let level = loop {
        let level = redis.level(&bucket("k"), &limit).await.unwrap();
        if level.next_in >= Duration::from_millis(400) || Instant::now() > deadline {
            break level;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    // Three tokens of debt, then the next: 400 ms at 10 a second.
    assert_eq!(
        (level.tokens, level.next_in),
        (0, Duration::from_millis(400))
    );
    for host in &hosts {
        assert!(
            host.acquire("k".to_owned(), 1).await.is_err(),
            "the debt first"
        );
    }
    let uncharged: u64 = hosts.iter().map(|h| h.stats().tokens_uncharged).sum();
    assert_eq!(uncharged, 0);
}

#[tokio::test(flavor = "current_thread")]
async fn skewed_host_clocks_do_not_change_the_answer() {
    let server = RedisServer::start();
    let redis = store(&server).await;
    // One token per hour: if any host's clock drove refills, hours of skew would mint tokens.
    let limit = Limit::per_hour(1).burst(10).unwrap();
    let skews = [0u64, 2 * 3600, 5 * 3600];
    let layers: Vec<_> = skews
        .iter()
        .map(|&skew| {
            let clock = ManualClock::new();
            clock.set(Duration::from_secs(skew));
            host_builder(&clock, limit)
                .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 1)
                .global_store(redis.clone())
                .build()
                .unwrap()
        })
        .collect();
    let mut hosts: Vec<_> = layers.iter().map(|l| l.layer(backend())).collect();
    let mut admitted = 0;
    for round in 0..10 {
        for host in &mut hosts {
            admitted += u32::from(send(host, &format!("skew-{round}"), 1).await == Outcome::Served);
            admitted += u32::from(send(host, "skew", 1).await == Outcome::Served);
        }
    }
    // Each of the ten "skew-n" keys is fresh (10 tokens): the three hosts take one each, 30 in
    // all. The shared key "skew" is asked 30 times and admits exactly its 10.
    assert_eq!(admitted, 30 + 10);
}

#[tokio::test(flavor = "current_thread")]
async fn a_three_primary_cluster_spreads_keys_over_slots_and_holds_limits() {
    let cluster = RedisCluster::start();
    let redis: RedisGlobalStore<String> = RedisGlobalStore::connect_cluster(cluster.urls())
        .await
        .expect("connect to the test's cluster");
    let clock = ManualClock::new();
    let limit = Limit::per_hour(5).burst(5).unwrap();
    let layers: Vec<_> = (0..2)
        .map(|_| {
            host_builder(&clock, limit)
                .global_store(redis.clone())
                .build()
                .unwrap()
        })
        .collect();
    let mut hosts: Vec<_> = layers.iter().map(|l| l.layer(backend())).collect();
    for k in 0..30 {
        let key = format!("tenant-{k}");
        let mut admitted = 0;
        for _ in 0..4 {
            for host in &mut hosts {
                admitted += u32::from(send(host, &key, 1).await == Outcome::Served);
            }
        }
        assert_eq!(admitted, 5, "key {key}");
    }
    let per_node: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| n.cli(&["dbsize"]).trim().parse().unwrap())
        .collect();
    assert_eq!(per_node.iter().sum::<u64>(), 30);
    assert!(
        per_node.iter().all(|&n| n > 0),
        "every primary holds buckets: {per_node:?}"
    );
    // Changes by hand reach each key's own node: every key served again after a reset.
    for k in 0..30 {
        let key = format!("tenant-{k}");
        let after = layers[k % 2]
            .adjust(&key, Adjustment::Reset)
            .await
            .expect("a reset on the key's node");
        assert_eq!(after[0].tokens, 5, "key {key}");
        assert_eq!(send(&mut hosts[k % 2], &key, 1).await, Outcome::Served);
    }
}

/// Scripts Redis has run (`EVALSHA` and `EVAL`, less those that failed: an `EVALSHA` of a
/// script the server did not know yet), from its command statistics.
fn scripts_run(server: &RedisServer) -> u64 {
    let stats = server.cli(&["info", "commandstats"]);
    let field = |line: &str, name: &str| -> u64 {
        line.split(',')
            .find_map(|f| f.split_once(&format!("{name}=")).map(|(_, v)| v.to_owned()))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    ["cmdstat_evalsha:", "cmdstat_eval:"]
        .iter()
        .filter_map(|name| stats.lines().find(|l| l.starts_with(name)))
        .map(|line| field(line, "calls") - field(line, "failed_calls"))
        .sum()
}

/// Fetches of many cold keys that fall due together go to Redis as a few scripts, each over
/// many buckets; with batches of one, each is a script of its own.
#[tokio::test(flavor = "current_thread")]
async fn fetches_of_many_keys_go_to_redis_as_one_script_per_batch() {
    for (batch, most) in [(128, 10), (1, 300)] {
        let server = RedisServer::start();
        let redis = store(&server).await;
        let layer = HierarchicalThrottleLayer::builder()
            .key(|k: &String| Some(k.clone()))
            .limit(Limit::per_second(100).burst(100).unwrap())
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .global_batch(batch)
            .global_store(redis)
            .build()
            .unwrap();
        let before = scripts_run(&server);
        let requests = (0..300).map(|k| layer.acquire(format!("key-{k}"), 1));
        let answers = futures_util::future::join_all(requests).await;
        assert!(answers.iter().all(Result::is_ok), "every key admitted");
        let scripts = scripts_run(&server) - before;
        let stats = layer.stats();
        assert_eq!(stats.global_calls, 300, "one call per key");
        assert_eq!(stats.global_batches, scripts, "a batch is a script");
        assert!(
            scripts <= most,
            "batches of {batch}: {scripts} scripts for 300 keys"
        );
        assert!(scripts >= 300_u64.div_ceil(batch as u64));
    }
}

/// On a Cluster, one batch holds keys of every slot: each script holds the buckets of one
/// slot, and every call gets its own bucket's answer.
#[tokio::test]
async fn a_batch_on_a_cluster_answers_each_bucket_from_its_own_slot() {
    use futures_util::StreamExt;
    use hierarchical_throttle::global::{Answer, Call};
    let cluster = RedisCluster::start();
    let redis: RedisGlobalStore<String> = RedisGlobalStore::connect_cluster(cluster.urls())
        .await
        .expect("connect to the test's cluster");
    let limit = Limit::per_hour(10).burst(10).unwrap();
    // Key k asks for k % 10 + 1 tokens, after a release into a bucket of its own.
    let calls: Vec<_> = (0..60)
        .flat_map(|k| {
            [
                Call::Release {
                    key: bucket(&format!("spare-{k}")),
                    limit,
                    back: TokenReturn::new(1),
                },
                Call::Acquire {
                    key: bucket(&format!("tenant-{k}")),
                    limit,
                    request: TokenRequest::now(1, k % 10 + 1),
                },
            ]
        })
        .collect();
    let mut answers: Vec<_> = redis.call_many(calls).collect().await;
    answers.sort_by_key(|(i, _)| *i);
    assert_eq!(answers.len(), 120);
    for (i, answer) in answers {
        let k = (i / 2) as u64;
        match (i % 2, answer) {
            (0, Ok(Answer::Released)) => {}
            (1, Ok(Answer::Granted(grant))) => {
                assert_eq!((grant.granted, grant.remaining), (k % 10 + 1, 9 - k % 10));
            }
            (_, other) => panic!("call {i}: {other:?}"),
        }
    }
    let per_node: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| n.cli(&["dbsize"]).trim().parse().unwrap())
        .collect();
    assert_eq!(
        per_node.iter().sum::<u64>(),
        60,
        "the 60 drawn buckets; the spares are full"
    );
}

/// A bucket (or a key's slot hash) whose Redis key holds something else (a string that is no
/// bucket's, or another type of value: something else wrote under the prefix) fails alone: the
/// others before and after it in the same script are answered, and its key is left as it was.
#[tokio::test]
async fn a_key_holding_another_type_fails_alone_in_its_batch() {
    use futures_util::StreamExt;
    use hierarchical_throttle::global::slots::{SlotHold, SlotStore};
    use hierarchical_throttle::global::{Answer, Call};
    let server = RedisServer::start();
    let redis = store(&server).await;
    let limit = Limit::per_hour(10).burst(10).unwrap();
    let poisoned = |k: &str| String::from_utf8(redis.redis_key(&bucket(k))).unwrap();
    // A string that is not a bucket's, and a value of another type.
    assert_eq!(
        server
            .cli(&["set", &poisoned("taken"), "not a bucket"])
            .trim(),
        "OK"
    );
    assert_eq!(
        server.cli(&["hset", &poisoned("given"), "t", "3"]).trim(),
        "1"
    );
    let acquire = |k: &str| Call::Acquire {
        key: bucket(k),
        limit,
        request: TokenRequest::now(1, 4),
    };
    let release = |k: &str| Call::Release {
        key: bucket(k),
        limit,
        back: TokenReturn::new(1),
    };
    let calls = vec![
        acquire("before"),
        acquire("taken"),
        release("given"),
        acquire("after"),
        release("spare"),
    ];
    let mut answers: Vec<_> = redis.call_many(calls).collect().await;
    answers.sort_by_key(|(i, _)| *i);
    let granted = |i: usize| match &answers[i].1 {
        Ok(Answer::Granted(grant)) => Some(grant.granted),
        _ => None,
    };
    assert_eq!((granted(0), granted(3)), (Some(4), Some(4)), "{answers:?}");
    assert!(matches!(answers[4].1, Ok(Answer::Released)), "{answers:?}");
    for i in [1, 2] {
        let error = answers[i].1.as_ref().expect_err("its key holds no bucket");
        assert!(!redis.may_have_applied(error), "it wrote nothing: {error}");
    }
    assert_eq!(
        server.cli(&["get", &poisoned("taken")]).trim(),
        "not a bucket"
    );
    assert_eq!(server.cli(&["hget", &poisoned("given"), "t"]).trim(), "3");

    let slots = |k: &str| poisoned(k) + ":slots";
    assert_eq!(
        server.cli(&["set", &slots("held"), "not slots"]).trim(),
        "OK"
    );
    let hold = |k: &str| {
        let hold = SlotHold {
            host: 7,
            seq: 1,
            want: 2,
            ttl: Duration::from_secs(10),
        };
        (bucket(k), 3, hold)
    };
    let holds = vec![hold("first"), hold("held"), hold("last")];
    let mut answers: Vec<_> = redis.hold_many(holds).collect().await;
    answers.sort_by_key(|(i, _)| *i);
    for i in [0, 2] {
        let holding = answers[i].1.as_ref().expect("its own hash answers");
        assert_eq!((holding.held, holding.others), (2, 0));
    }
    let error = answers[1].1.as_ref().expect_err("its hash is a string");
    assert!(!redis.may_have_applied(error), "it wrote nothing: {error}");
    assert_eq!(server.cli(&["get", &slots("held")]).trim(), "not slots");
}

/// A server that refuses every write (out of memory under the default `noeviction` policy, or a
/// replica) fails a batch's every bucket, and every slot holding, with its own error (`OOM`,
/// `READONLY`, which tells a Sentinel client to find the primary again), having written
/// nothing: not as keys that hold something else.
#[tokio::test]
async fn a_server_that_refuses_writes_fails_a_batch_in_its_own_words() {
    let server = RedisServer::start();
    let redis = store(&server).await;
    let limit = Limit::per_hour(10).burst(10).unwrap();
    let calls = || {
        vec![
            Call::Acquire {
                key: bucket("first"),
                limit,
                request: TokenRequest::now(1, 4),
            },
            Call::Release {
                key: bucket("second"),
                limit,
                back: TokenReturn::new(1),
            },
        ]
    };
    let holds = || vec![(bucket("first"), 3, slot_hold(7, 1, 2))];
    let refused_in = |store: RedisGlobalStore<String>, code: &'static str| async move {
        use futures_util::StreamExt;
        use hierarchical_throttle::global::slots::SlotStore;
        let answers: Vec<_> = store.call_many(calls()).collect().await;
        let holdings: Vec<_> = store.hold_many(holds()).collect().await;
        let errors = (answers.iter().map(|(_, a)| a.as_ref().err()))
            .chain(holdings.iter().map(|(_, h)| h.as_ref().err()));
        for error in errors {
            let error = error.expect("the server refuses every write");
            assert_eq!(error.code(), Some(code), "{error}");
            assert!(!store.may_have_applied(error), "nothing written: {error}");
        }
        assert_eq!((answers.len(), holdings.len()), (2, 1));
    };

    assert!(
        server
            .cli(&["config", "set", "maxmemory", "1"])
            .contains("OK")
    );
    refused_in(redis.clone(), "OOM").await;
    // Through layers, each store failure is answered by the layer's failure policy.
    let layers = policy_hosts(&redis, &ManualClock::new(), Duration::from_secs(1));
    let [mut open, mut closed] = [0, 1].map(|i| layers[i].layer(backend()));
    assert_eq!(send(&mut open, "full", 1).await, Outcome::Served);
    assert!(matches!(
        send(&mut closed, "full", 1).await,
        Outcome::Refused(RejectionReason::StoreUnavailable, Some(_))
    ));
    assert!(layers.iter().take(2).all(|l| l.stats().global_errors == 1));
    let replica = RedisServer::start_replica_of(server.port);
    refused_in(store(&replica).await, "READONLY").await;
    assert!(
        server
            .cli(&["config", "set", "maxmemory", "0"])
            .contains("OK")
    );
    assert_eq!(server.cli(&["dbsize"]).trim(), "0", "nothing written");
    let grant = redis
        .acquire(&bucket("first"), &limit, TokenRequest::now(1, 4))
        .await;
    assert_eq!(grant.expect("memory freed").granted, 4);
}

#[tokio::test]
async fn hostile_keys_get_distinct_redis_keys_and_buckets() {
    let server = RedisServer::start();
    let redis = store(&server).await;
    let long = "x".repeat(10_000);
    let keys: Vec<String> = vec![
        "plain".into(),
        "with space".into(),
        "a{b}".into(),
        "a%7Bb%7D".into(),
        "}{".into(),
        "line\nbreak".into(),
        "line\r\nbreak".into(),
        "\"quoted\" 'and' \\slashed".into(),
        "ünïcødé".into(),
        "".into(),
        long.clone(),
        format!("{long}y"),
    ];
    let keys: Vec<BucketKey<String>> = keys.iter().map(|k| bucket(k)).collect();
    let redis_keys: std::collections::HashSet<Vec<u8>> =
        keys.iter().map(|k| redis.redis_key(k)).collect();
    assert_eq!(
        redis_keys.len(),
        keys.len(),
        "no two keys share a Redis key"
    );
    for rk in &redis_keys {
        let tag = &rk[b"throttle:".len()..rk.len() - b":default".len()];
        assert!(rk.ends_with(b"}:default"));
        assert!(tag.starts_with(b"{") && tag.ends_with(b"}"));
        assert!(
            !tag[1..tag.len() - 1]
                .iter()
                .any(|b| matches!(b, b'{' | b'}' | b'\n' | b' '))
        );
    }
    let limit = Limit::per_hour(2).burst(2).unwrap();
    for key in &keys {
        let grant = redis
            .acquire(key, &limit, TokenRequest::now(1, 2))
            .await
            .unwrap();
        assert_eq!(grant.granted, 2, "key {key:?} has its own full bucket");
    }
    let mut conn = raw(&server).await;
    let stored: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(stored, keys.len() as u64);
    assert!(redis.clone().with_prefix("bad{prefix").is_err());
}

/// A host per failure policy on one Redis, on `clock`.
fn policy_hosts(
    redis: &RedisGlobalStore<String>,
    clock: &ManualClock,
    timeout: Duration,
) -> Vec<HostLayer<RedisGlobalStore<String>>> {
    let limit = Limit::per_hour(20).burst(20).unwrap();
    [
        FailurePolicy::Admit,
        FailurePolicy::Reject,
        FailurePolicy::local_fallback(4).unwrap(),
    ]
    .into_iter()
    .map(|policy| {
        host_builder(clock, limit)
            .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 1)
            .failure_policy(policy)
            .store_timeout(timeout)
            .max_store_backoff(Duration::from_millis(200))
            .global_store(redis.clone())
            .build()
            .unwrap()
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_load_follows_each_policy_and_limits_hold_after_restart() {
    let mut server = RedisServer::start();
    let redis = store(&server).await;
    let timeout = Duration::from_millis(50);
    // The hosts' clock follows real time here: back-offs must pass.
    let clock = ManualClock::new();
    let origin = Instant::now();
    let layers = policy_hosts(&redis, &clock, timeout);
    let mut hosts: Vec<_> = layers.iter().map(|l| l.layer(backend())).collect();
    let timed = async |host: &mut _, key: &str| {
        clock.set(origin.elapsed());
        let start = Instant::now();
        let outcome = send(host, key, 1).await;
        let waited = start.elapsed();
        // The time-out, plus scheduling slack on a loaded 2-core machine.
        assert!(
            waited < timeout + Duration::from_millis(40),
            "waited {waited:?}"
        );
        outcome
    };

    // Before the crash: each host's key is decided by Redis.
    for (i, host) in hosts.iter_mut().enumerate() {
        for _ in 0..5 {
            assert_eq!(timed(host, &format!("before-{i}")).await, Outcome::Served);
        }
    }
    server.kill();
    let mut after: Vec<Vec<Outcome>> = vec![Vec::new(); 3];
    for (i, host) in hosts.iter_mut().enumerate() {
        for _ in 0..8 {
            after[i].push(timed(host, &format!("during-{i}")).await);
        }
    }
    assert!(
        after[0].iter().all(|o| *o == Outcome::Served),
        "fail open: {:?}",
        after[0]
    );
    assert!(
        after[1].iter().all(|o| matches!(
            o,
            Outcome::Refused(RejectionReason::StoreUnavailable, Some(_))
        )),
        "fail closed: {:?}",
        after[1]
    );
    // A quarter of 20 on this host alone: 5 served, then throttled.
    let served = after[2].iter().filter(|o| **o == Outcome::Served).count();
    assert_eq!(served, 5, "local fallback: {:?}", after[2]);
    assert!(layers.iter().all(|l| l.stats().fallback_decisions > 0));
    assert!(
        layers
            .iter()
            .all(|l| l.stats().global_errors + l.stats().global_timeouts > 0)
    );

    // Back up, empty: after the back-off, a new key gets exactly its 20 from Redis.
    server.restart();
    let recovered = Instant::now();
    let mut served = 0;
    while served == 0 {
        assert!(
            recovered.elapsed() < Duration::from_secs(2),
            "did not recover"
        );
        served = u32::from(timed(&mut hosts[1], "recovered").await == Outcome::Served);
        tokio::task::yield_now().await;
    }
    println!(
        "back on the global limit {:?} after the restart",
        recovered.elapsed()
    );
    for _ in 0..30 {
        served += u32::from(timed(&mut hosts[1], "recovered").await == Outcome::Served);
    }
    assert_eq!(served, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_trips_the_time_out() {
    let server = RedisServer::start();
    let redis = store(&server).await;
    let timeout = Duration::from_millis(40);
    let layers = policy_hosts(&redis, &ManualClock::new(), timeout);
    let mut host = layers[0].layer(backend());
    assert_eq!(send(&mut host, "warm", 1).await, Outcome::Served);
    server.pause();
    let start = Instant::now();
    assert_eq!(
        send(&mut host, "frozen", 1).await,
        Outcome::Served,
        "fail open"
    );
    let waited = start.elapsed();
    server.resume();
    assert!(
        waited >= timeout && waited < timeout + Duration::from_millis(40),
        "waited {waited:?}"
    );
    settle_background().await;
    assert_eq!(layers[0].stats().global_timeouts, 1);
}

/// A key named `<prefix>-<n>` for each of the cluster's three primaries, in the primaries'
/// order: a node owns a key when it answers for it without a redirection.
fn one_key_per_primary(
    cluster: &RedisCluster,
    redis: &RedisGlobalStore<String>,
    prefix: &str,
) -> Vec<BucketKey<String>> {
    let owner = |key: &BucketKey<String>| {
        let redis_key = String::from_utf8(redis.redis_key(key)).unwrap();
        cluster
            .nodes
            .iter()
            .position(|n| !n.cli(&["exists", &redis_key]).contains("MOVED"))
            .expect("some node owns every slot")
    };
    let mut keys: Vec<Option<BucketKey<String>>> = vec![None; 3];
    for k in 0.. {
        let key = bucket(&format!("{prefix}-{k}"));
        let node = owner(&key);
        keys[node].get_or_insert(key);
        if keys.iter().all(Option::is_some) {
            break;
        }
    }
    keys.into_iter().map(Option::unwrap).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_primary_delays_only_the_keys_it_serves() {
    let cluster = RedisCluster::start();
    let redis: RedisGlobalStore<String> = RedisGlobalStore::connect_cluster(cluster.urls())
        .await
        .expect("connect to the test's cluster");
    let limit = Limit::per_hour(100).burst(100).unwrap();
    let keys = one_key_per_primary(&cluster, &redis, "node-key");
    for key in &keys {
        let grant = redis.acquire(key, &limit, TokenRequest::now(1, 1)).await;
        assert_eq!(grant.expect("a healthy cluster answers").granted, 1);
    }
    // Every node forgets the scripts, as after restarts; then primary 0 stalls.
    for node in &cluster.nodes {
        assert!(node.cli(&["script", "flush"]).contains("OK"));
    }
    cluster.nodes[0].pause();
    for key in &keys[1..] {
        let call = redis.acquire(key, &limit, TokenRequest::now(1, 1));
        let answer = tokio::time::timeout(Duration::from_secs(2), call).await;
        let grant = answer.expect("a healthy primary answers while another is stalled");
        assert_eq!(
            grant.expect("the script is loaded where it runs").granted,
            1
        );
    }
    let stalled = redis.acquire(&keys[0], &limit, TokenRequest::now(1, 1));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), stalled)
            .await
            .is_err(),
        "the stalled primary's own keys wait"
    );
    cluster.nodes[0].resume();
}

/// What the store answers for `key` asked alone and in a batch beside another key: one token
/// ((granted, remaining) each time), and one of its concurrency slots for host 8 (held,
/// others).
async fn asked_alone_and_in_a_batch(
    redis: &RedisGlobalStore<String>,
    key: &BucketKey<String>,
    limit: Limit,
    seq: u64,
) -> [(u64, u64); 3] {
    use futures_util::StreamExt;
    use hierarchical_throttle::global::slots::SlotStore;
    let alone = redis
        .acquire(key, &limit, TokenRequest::now(1, 1))
        .await
        .expect("the key's primary answers");
    let calls = [key.clone(), bucket("bystander")].map(|key| Call::Acquire {
        key,
        limit,
        request: TokenRequest::now(1, 1),
    });
    let mut answers: Vec<_> = redis.call_many(calls.into()).collect().await;
    answers.sort_by_key(|(i, _)| *i);
    let in_batch = match answers.swap_remove(0) {
        (0, Ok(Answer::Granted(grant))) => grant,
        other => panic!("the moving key's answer in a batch: {other:?}"),
    };
    let holds = [key.clone(), bucket("bystander")].map(|key| (key, 2, slot_hold(8, seq, 1)));
    let mut held: Vec<_> = redis.hold_many(holds.into()).collect().await;
    held.sort_by_key(|(i, _)| *i);
    let slot = held
        .swap_remove(0)
        .1
        .expect("the key's primary holds slots");
    [
        (alone.granted, alone.remaining),
        (in_batch.granted, in_batch.remaining),
        (slot.held, slot.others),
    ]
}

/// A hold of `want` slots for 10 minutes.
fn slot_hold(host: u64, seq: u64, want: u64) -> SlotHold {
    SlotHold {
        host,
        seq,
        want,
        ttl: Duration::from_secs(600),
    }
}

/// Resharding moves a bucket, and a key's slot holdings, with their levels: a key that spent
/// its burst and whose concurrency slots another host holds stays refused while its slot
/// migrates (once the keys have moved, their old primary redirects with `ASK`, to a primary
/// that has not loaded the scripts) and after (`MOVED`), asked alone and in a batch. Buckets
/// or holdings made anew on the new primary would grant a whole burst, or the slots, again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_keeps_its_level_while_its_slot_moves_to_another_primary() {
    use futures_util::StreamExt;
    use hierarchical_throttle::global::slots::SlotStore;
    let cluster = RedisCluster::start();
    let redis: RedisGlobalStore<String> = RedisGlobalStore::connect_cluster(cluster.urls())
        .await
        .expect("connect to the test's cluster");
    let limit = Limit::per_hour(10).burst(10).unwrap();
    let key = one_key_per_primary(&cluster, &redis, "moving").swap_remove(0);
    let spent = redis.acquire(&key, &limit, TokenRequest::now(10, 10)).await;
    assert_eq!(spent.expect("a healthy cluster answers").granted, 10);
    let taken = redis.hold_many(vec![(key.clone(), 2, slot_hold(7, 1, 2))]);
    let taken = taken.collect::<Vec<_>>().await.swap_remove(0).1;
    assert_eq!(taken.expect("a healthy cluster holds slots").held, 2);
    let redis_key = String::from_utf8(redis.redis_key(&key)).unwrap();
    let slots_key = format!("{redis_key}:slots");
    let (from, to) = (&cluster.nodes[0], &cluster.nodes[1]);
    let slot = from
        .cli(&["cluster", "keyslot", &redis_key])
        .trim()
        .to_owned();
    let id = |node: &RedisServer| node.cli(&["cluster", "myid"]).trim().to_owned();
    for node in &cluster.nodes {
        assert!(node.cli(&["script", "flush"]).contains("OK"));
    }
    let refused = [(0, 0), (0, 0), (0, 2)];

    let importing = to.cli(&["cluster", "setslot", &slot, "importing", &id(from)]);
    let migrating = from.cli(&["cluster", "setslot", &slot, "migrating", &id(to)]);
    assert!(importing.contains("OK") && migrating.contains("OK"));
    assert_eq!(
        asked_alone_and_in_a_batch(&redis, &key, limit, 1).await,
        refused,
        "migrating, the keys still on their old primary"
    );

    let port = to.port.to_string();
    let keys = [redis_key.as_str(), slots_key.as_str()];
    let mut args = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
    args.extend(keys);
    assert!(from.cli(&args).contains("OK"), "the keys move");
    assert_eq!(
        asked_alone_and_in_a_batch(&redis, &key, limit, 2).await,
        refused,
        "migrating, the keys on their new primary (ASK)"
    );
    let stats = to.cli(&["info", "commandstats"]);
    assert!(
        stats.contains("cmdstat_asking"),
        "redirected by ASK: {stats}"
    );

    for node in &cluster.nodes {
        assert!(
            node.cli(&["cluster", "setslot", &slot, "node", &id(to)])
                .contains("OK")
        );
    }
    assert_eq!(
        asked_alone_and_in_a_batch(&redis, &key, limit, 3).await,
        refused,
        "moved (MOVED)"
    );
    for moved in keys {
        assert!(from.cli(&["exists", moved]).contains("MOVED"));
        assert_eq!(to.cli(&["exists", moved]).trim(), "1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_stalls_and_dropped_connections_never_over_admit() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port).await;
    let redis: RedisGlobalStore<String> = RedisGlobalStore::connect(&proxy.url())
        .await
        .expect("connect through the proxy");
    let limit = Limit::per_second(200).burst(50).unwrap();
    let layers: Vec<_> = (0..3)
        .map(|_| {
            HierarchicalThrottleLayer::builder()
                .cold_start(hierarchical_throttle::ColdStart::Exact)
                .key(|job: &Job| job.key.clone())
                .limit(limit)
                .failure_policy(FailurePolicy::Reject)
                .store_timeout(Duration::from_millis(50))
                .max_store_backoff(Duration::from_millis(100))
                .on_rejection(refuse as Rejector)
                .global_store(redis.clone())
                .build()
                .unwrap()
        })
        .collect();
    let admitted = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let run_for = Duration::from_millis(2_500);
    let mut tasks = tokio::task::JoinSet::new();
    for layer in &layers {
        for _ in 0..10 {
            let admitted = admitted.clone();
            let mut host = layer.layer(service_fn(move |_: Job| {
                admitted.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, std::convert::Infallible>(Outcome::Served) }
            }));
            tasks.spawn(async move {
                while start.elapsed() < run_for {
                    let _ = send(&mut host, "shared", 1).await;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            });
        }
    }
    // Latency (each way, so 20 ms is 40 of the 50 ms time-out), a stall past the time-out,
    // dropped connections.
    let phases: [(u64, &dyn Fn()); 6] = [
        (0, &|| proxy.latency(Duration::from_millis(10))),
        (500, &|| proxy.latency(Duration::from_millis(20))),
        (1_000, &|| proxy.stall(true)),
        (1_300, &|| {
            proxy.stall(false);
            proxy.drop_connections();
            proxy.latency(Duration::from_millis(5));
        }),
        (1_800, &|| proxy.drop_connections()),
        (2_100, &|| proxy.latency(Duration::ZERO)),
    ];
    for (at, fault) in phases {
        tokio::time::sleep_until((start + Duration::from_millis(at)).into()).await;
        fault();
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = start.elapsed();
    let admitted = admitted.load(Ordering::SeqCst);
    let allowed = limit.capacity() + (elapsed.as_micros() as u64) * 200 / 1_000_000;
    let stats: Vec<_> = layers.iter().map(|l| l.stats()).collect();
    println!("admitted {admitted} of {allowed} in {elapsed:?}; {stats:?}");
    assert!(
        admitted <= allowed,
        "over-admission: {admitted} > {allowed}"
    );
    // Tokens of calls that timed out are lost by design (they may have been dispensed), so
    // the fleet serves less than its allowance here, but it serves.
    assert!(
        admitted * 3 >= allowed,
        "the fleet still served: {admitted} of {allowed}"
    );
    let timeouts: u64 = stats.iter().map(|s| s.global_timeouts).sum();
    assert!(timeouts > 0, "the stall timed calls out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_starts_while_redis_is_down_and_moves_to_redis_once_it_is_up() {
    let port = RedisServer::unused_port();
    let redis: RedisGlobalStore<String> =
        RedisGlobalStore::open(&format!("redis://127.0.0.1:{port}")).expect("a valid url");
    let clock = ManualClock::new();
    let layer = host_builder(&clock, Limit::per_hour(3).burst(3).unwrap())
        .failure_policy(FailurePolicy::Reject)
        .global_store(redis)
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    let unavailable = Outcome::Refused(
        RejectionReason::StoreUnavailable,
        Some(Duration::from_millis(50)),
    );
    assert_eq!(
        send(&mut host, "k", 1).await,
        unavailable,
        "the policy decides"
    );
    let server = RedisServer::start_on(port);
    // Within the back-off the store is left alone; after it, Redis decides.
    assert!(matches!(
        send(&mut host, "k", 1).await,
        Outcome::Refused(RejectionReason::StoreUnavailable, _)
    ));
    clock.advance(Duration::from_millis(50));
    for _ in 0..3 {
        assert_eq!(send(&mut host, "k", 1).await, Outcome::Served);
    }
    assert!(matches!(
        send(&mut host, "k", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));
    let mut conn = raw(&server).await;
    let stored: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(stored, 1, "the bucket lives in Redis");
}

/// The first call of a store opened while Redis is down fails at once with the connection's
/// error (counted as an error, not as a time-out of the default 50 ms), and the store says
/// where it is for logs, without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_opened_while_redis_is_down_fails_at_once_with_its_error() {
    let port = RedisServer::unused_port();
    let redis: RedisGlobalStore<String> =
        RedisGlobalStore::open(&format!("redis://:secret@127.0.0.1:{port}")).expect("a valid url");
    assert_eq!(redis.location(), format!("redis at 127.0.0.1:{port}"));
    let clock = ManualClock::new();
    let layer = host_builder(&clock, Limit::per_hour(3).burst(3).unwrap())
        .failure_policy(FailurePolicy::Reject)
        .global_store(redis)
        .build()
        .unwrap();
    let mut host = layer.layer(backend());
    let started = Instant::now();
    assert!(matches!(
        send(&mut host, "k", 1).await,
        Outcome::Refused(RejectionReason::StoreUnavailable, _)
    ));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let stats = layer.stats();
    assert_eq!((stats.global_errors, stats.global_timeouts), (1, 0));
}

/// Two layers of other names on one Redis keep their buckets apart: the stricter one neither
/// clamps nor expires the other's.
#[tokio::test(flavor = "current_thread")]
async fn layers_of_other_names_on_one_redis_keep_their_buckets_apart() {
    let server = RedisServer::start();
    let redis = store(&server).await;
    let clock = ManualClock::new();
    let strict = host_builder(&clock, Limit::per_minute(1).build().unwrap())
        .name("login")
        .global_store(redis.clone())
        .build()
        .unwrap();
    let budget = host_builder(&clock, Limit::per_minute(10_000).build().unwrap())
        .name("llm")
        .global_store(redis.clone())
        .build()
        .unwrap();
    let unnamed = host_builder(&clock, Limit::per_minute(5).build().unwrap())
        .global_store(redis.clone())
        .build()
        .unwrap();
    // Same name, other limits, same store: refused at build.
    assert!(
        host_builder(&clock, Limit::per_minute(6).build().unwrap())
            .global_store(redis.clone())
            .build()
            .is_err()
    );
    let (mut strict, mut budget, mut unnamed) = (
        strict.layer(backend()),
        budget.layer(backend()),
        unnamed.layer(backend()),
    );
    assert_eq!(send(&mut strict, "u", 1).await, Outcome::Served);
    assert!(matches!(
        send(&mut strict, "u", 1).await,
        Outcome::Refused(RejectionReason::Throttled, _)
    ));
    for _ in 0..10 {
        assert_eq!(send(&mut budget, "u", 1_000).await, Outcome::Served);
    }
    for _ in 0..5 {
        assert_eq!(send(&mut unnamed, "u", 1).await, Outcome::Served);
    }
    let mut conn = raw(&server).await;
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    keys.sort();
    assert_eq!(
        keys,
        [
            "throttle:{u}:default",
            "throttle:{u}:llm:default",
            "throttle:{u}:login:default"
        ]
    );
}

#[tokio::test]
async fn an_acl_user_limited_to_the_prefix_and_the_scripts_commands_is_enough() {
    let server = RedisServer::start();
    let acl = server.cli(&[
        "acl",
        "setuser",
        "throttler",
        "on",
        ">s3cret",
        "resetkeys",
        "~throttle:*",
        "-@all",
        "+evalsha",
        "+eval",
        "+get",
        "+set",
        "+del",
        "+time",
    ]);
    assert!(acl.contains("OK"), "{acl}");
    let url = format!("redis://throttler:s3cret@127.0.0.1:{}", server.port);
    let redis: RedisGlobalStore<String> = RedisGlobalStore::connect(&url).await.unwrap();
    let limit = Limit::per_hour(10).burst(10).unwrap();
    let grant = redis
        .acquire(&bucket("tenant"), &limit, TokenRequest::now(1, 4))
        .await
        .expect("the user may run the acquire script on its prefix");
    assert_eq!(grant.granted, 4);
    redis
        .release(&bucket("tenant"), &limit, TokenReturn::new(4))
        .await
        .expect("and the release script");
    let level = redis
        .level(&bucket("tenant"), &limit)
        .await
        .expect("and the read-only level script");
    assert_eq!(level.tokens, 10);
    // Outside its prefix the same user is refused: the rights above are all it has.
    let elsewhere = redis.clone().with_prefix("other:").unwrap();
    let refused = elsewhere
        .acquire(&bucket("tenant"), &limit, TokenRequest::now(1, 1))
        .await;
    assert!(refused.is_err(), "{refused:?}");

    // Slots of a concurrency limit need the four commands of their hashes besides.
    use hierarchical_throttle::global::slots::{SlotHold, SlotStore};
    let hold = SlotHold {
        host: 1,
        seq: 1,
        want: 2,
        ttl: Duration::from_secs(10),
    };
    let without = redis.hold(&bucket("tenant"), 3, hold).await;
    assert!(without.is_err(), "{without:?}");
    let more = server.cli(&[
        "acl",
        "setuser",
        "throttler",
        "+hgetall",
        "+hset",
        "+hdel",
        "+pexpire",
    ]);
    assert!(more.contains("OK"), "{more}");
    let holding = redis.hold(&bucket("tenant"), 3, hold).await;
    assert_eq!(holding.expect("and the slot script").held, 2);
}

#[tokio::test]
async fn a_fleet_with_several_limits_and_levels_never_over_admits_any_bucket_on_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(2_000_000));
    let redis = store(&server).await.with_clock_override(clock.clone());
    common::levels::fleet_holds_every_bucket(&clock, redis.clone()).await;
    // Every limit of every level has a bucket of its own, under the key's hash tag: stored,
    // unless it is full (a full bucket is no key). The users' per-minute limits bind; the
    // others may have refilled by the end.
    let mut conn = raw(&server).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("throttle:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let at_level = |key: &str, level: &str| {
        BucketKey::new(key.to_owned(), "default")
            .and_then(|b| b.at_level(level))
            .unwrap()
    };
    for (expected, bucket, limit) in [
        (
            "throttle:{u0}:per-second",
            BucketKey::new("u0".to_owned(), "per-second").unwrap(),
            Limit::per_second(5).burst(5).unwrap(),
        ),
        (
            "throttle:{u0}:per-minute",
            BucketKey::new("u0".to_owned(), "per-minute").unwrap(),
            Limit::per_minute(120).burst(20).unwrap(),
        ),
        (
            "throttle:{acme}:tenant/default",
            at_level("acme", "tenant"),
            Limit::per_second(12).burst(12).unwrap(),
        ),
        (
            "throttle:{bulk}:route/default",
            at_level("bulk", "route"),
            Limit::per_second(4).burst(4).unwrap(),
        ),
    ] {
        if !keys.iter().any(|k| k == expected) {
            let level = redis.level(&bucket, &limit).await.unwrap();
            assert_eq!(level.tokens, limit.capacity(), "{expected} in {keys:?}");
        }
    }
    assert!(
        keys.iter().any(|k| k == "throttle:{u0}:per-minute"),
        "the binding limit's bucket is stored: {keys:?}"
    );
}

#[tokio::test]
async fn a_fleet_on_redis_warms_up_and_never_beats_a_single_cold_bucket() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = server.store_on(&clock).await;
    common::warm_up::fleet_warms_up(&clock, redis).await;
}

#[tokio::test]
async fn a_fleet_on_redis_never_carries_a_window_s_tokens_into_the_next() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = server.store_on(&clock).await;
    common::calendar::fleet_crosses_midnight(&clock, redis).await;
}

#[tokio::test]
async fn a_day_spent_before_midnight_on_redis_is_whole_just_after() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = server.store_on(&clock).await;
    common::calendar::a_day_spent_before_midnight_is_whole_just_after(&clock, redis).await;
}

/// Paris's day of 25 hours on Redis: the script's window ends at local midnight, an hour
/// after the day's morning offset would end it.
#[tokio::test]
async fn a_fleet_on_redis_keeps_paris_s_day_of_25_hours_whole() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = server.store_on(&clock).await;
    common::calendar::fleet_crosses_the_end_of_a_long_day(&clock, redis).await;
}

/// The same on a 3-primary Cluster: the calendar arithmetic runs in the script of the node
/// that holds the key's slot. Paris's day of 25 hours first, then a UTC midnight a month later
/// (the same bucket, its clock moved on).
#[tokio::test]
async fn a_fleet_on_a_redis_cluster_never_carries_a_window_s_tokens_into_the_next() {
    let cluster = RedisCluster::start();
    let on_clock = async |clock: &ManualClock| {
        RedisGlobalStore::<String>::connect_cluster(cluster.urls())
            .await
            .expect("connect to the test's cluster")
            .with_clock_override(clock.clone())
    };
    let clock = ManualClock::new();
    let redis = on_clock(&clock).await;
    common::calendar::fleet_crosses_the_end_of_a_long_day(&clock, redis).await;
    let clock = ManualClock::new();
    let redis = on_clock(&clock).await;
    common::calendar::fleet_crosses_midnight(&clock, redis).await;
}

/// Three shaping hosts on one real Redis, on real time: bursts wait for their tokens instead
/// of being refused, and the fleet never serves more than `capacity + rate × elapsed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shaping_hosts_on_redis_wait_for_tokens_and_never_over_admit() {
    use hierarchical_throttle::Shaping;

    let server = RedisServer::start();
    let redis = store(&server).await;
    let limit = Limit::per_second(100).burst(5).unwrap();
    let start = Instant::now();
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hosts: Vec<_> = (0..3)
        .map(|_| {
            let layer = HierarchicalThrottleLayer::builder()
                .cold_start(hierarchical_throttle::ColdStart::Exact)
                .key(|job: &Job| job.key.clone())
                .cost(|job: &Job| job.cost)
                .limit(limit)
                .shaping(Shaping::wait(Duration::from_secs(2)))
                .global_store(redis.clone())
                .on_rejection(|_: &Job, r: hierarchical_throttle::Rejection<String>| {
                    Ok::<_, std::convert::Infallible>(Outcome::Refused(r.reason, r.retry_after))
                })
                .build()
                .unwrap();
            let served = served.clone();
            layer.layer(service_fn(move |_: Job| {
                served.lock().unwrap().push(start.elapsed());
                async { Ok::<_, std::convert::Infallible>(Outcome::Served) }
            }))
        })
        .collect();

    let mut calls = tokio::task::JoinSet::new();
    for host in &hosts {
        for _ in 0..20 {
            let host = host.clone();
            calls.spawn(async move { send(&mut host.clone(), "burst", 1).await });
        }
    }
    while let Some(outcome) = calls.join_next().await {
        assert_eq!(
            outcome.unwrap(),
            Outcome::Served,
            "every request waits and is served"
        );
    }
    let mut served = served.lock().unwrap().clone();
    served.sort();
    assert_eq!(served.len(), 60);
    for (n, at) in (1u128..).zip(&served) {
        // One token of slack for the two clocks (Redis's and this process's) reading the same
        // instant a few microseconds apart.
        let allowed = 5 + 1 + at.as_micros() * 100 / 1_000_000;
        assert!(n <= allowed, "{n} served by {at:?}, allowed {allowed}");
    }
    assert!(
        served[59] >= Duration::from_millis(540),
        "55 tokens at 100/s cannot come before 550 ms: the last came at {:?}",
        served[59]
    );
}

/// Polls `check` every 20 ms for up to `secs` seconds (a real server's state, which no event
/// announces to the test); panics with `what` if it never holds.
/// The whole tokens of a bucket's value as `redis-cli get` prints it.
fn tokens_of(value: &str) -> i64 {
    let first = value.split(' ').next().unwrap_or_default();
    first
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a bucket: {value:?}"))
}

async fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "{what} within {secs} s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A primary, its replica and a sentinel; the layer finds the primary through the sentinel.
/// After `SENTINEL FAILOVER`, the calls that reach the old primary (now a read-only replica)
/// fail and the failure policy answers; then the layer asks the sentinel again and decides on
/// the new primary, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_moves_decisions_to_the_new_primary() {
    use common::redis_server::Sentinel;

    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(primary.port);
    eventually(20, "the replica is in sync", || {
        replica
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
    })
    .await;
    let sentinel = Sentinel::start("throttle", primary.port);
    let replica_port = replica.port.to_string();
    eventually(20, "the sentinel knows the replica", || {
        sentinel
            .cli(&["sentinel", "replicas", "throttle"])
            .contains(&replica_port)
    })
    .await;

    let store: RedisGlobalStore<String> =
        RedisGlobalStore::connect_sentinel([sentinel.url()], "throttle").unwrap();
    let layer = HierarchicalThrottleLayer::builder()
        .cold_start(hierarchical_throttle::ColdStart::Exact)
        .key(|job: &Job| job.key.clone())
        .limit(Limit::per_day(1_000).build().unwrap()) // no refill worth a token in the test
        // One token per call, so that every use asks Redis.
        .batch_policy(|_: &hierarchical_throttle::batch::BatchContext<'_>| 0)
        .failure_policy(FailurePolicy::Reject)
        .store_timeout(Duration::from_millis(500))
        .max_store_backoff(Duration::from_millis(100))
        .global_store(store)
        .build()
        .unwrap();
    let bucket_key = "throttle:{tenant}:default";

    assert_eq!(
        layer
            .acquire("tenant".to_owned(), 1)
            .await
            .map(|a| a.from_leases()),
        Ok(true)
    );
    assert_eq!(tokens_of(&primary.cli(&["get", bucket_key])), 999);

    // The sentinel accepts a failover once it has heard from the replica itself.
    eventually(20, "the sentinel starts a failover", || {
        sentinel
            .cli(&["sentinel", "failover", "throttle"])
            .contains("OK")
    })
    .await;
    eventually(20, "the sentinel names the replica as primary", || {
        sentinel
            .cli(&["sentinel", "get-master-addr-by-name", "throttle"])
            .contains(&replica_port)
    })
    .await;
    // Until the old primary is turned into a replica it still takes writes (which the new
    // primary never sees: Redis replicates asynchronously); wait for that, as the docs warn.
    eventually(20, "the old primary is a replica", || {
        primary.cli(&["role"]).contains("slave")
    })
    .await;

    let mut unavailable = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match layer.acquire("tenant".to_owned(), 1).await {
            Ok(_) => break,
            Err(refusal) => {
                assert_eq!(
                    refusal.reason,
                    RejectionReason::StoreUnavailable,
                    "{refusal:?}"
                );
                unavailable += 1;
            }
        }
        assert!(Instant::now() < deadline, "no decision on the new primary");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The new primary holds the bucket (replicated, then one more token taken there).
    assert_eq!(tokens_of(&replica.cli(&["get", bucket_key])), 998);
    assert!(
        (1..=20).contains(&unavailable),
        "{unavailable} refusals before the new primary answered: the old primary, now a \
         replica, refuses the first write"
    );
}

/// `rediss://` to a server that speaks TLS only, verified against the certificate authority
/// that signed its certificate; a client without that authority is refused.
#[cfg(feature = "tls")]
#[tokio::test]
async fn tls_to_redis_verifies_the_server_and_decides_there() {
    let (server, ca) = RedisServer::start_tls();
    let url = format!("rediss://127.0.0.1:{}", server.port);
    let roots = redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(ca),
    };
    let client = redis::Client::build_with_tls(url.as_str(), roots).unwrap();
    let store: RedisGlobalStore<String> = RedisGlobalStore::connect_client(client).await.unwrap();
    let limit = Limit::per_hour(10).burst(10).unwrap();
    let grant = store
        .acquire(&bucket("tenant"), &limit, TokenRequest::now(1, 4))
        .await
        .expect("an acquire over TLS");
    assert_eq!(grant.granted, 4);
    assert_eq!(
        store.level(&bucket("tenant"), &limit).await.unwrap().tokens,
        6
    );

    // The system's roots do not know the test's authority: the handshake fails.
    let untrusted = RedisGlobalStore::<String>::connect(&url).await;
    assert!(
        untrusted.is_err(),
        "a server signed by an unknown authority is refused"
    );
    // Nor does the port speak plain Redis.
    let plain =
        RedisGlobalStore::<String>::connect(&format!("redis://127.0.0.1:{}", server.port)).await;
    assert!(plain.is_err(), "plain Redis on a TLS-only port");
}

/// Bodies charged by the byte on a real Redis: two hosts streaming at once deliver no more
/// than the quota fleet-wide.
#[tokio::test(flavor = "current_thread")]
async fn metered_bodies_on_two_hosts_share_one_redis_quota() {
    use http_body_util::BodyExt;
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = store(&server).await.with_clock_override(clock.clone());
    let host = || {
        HierarchicalThrottleLayer::builder()
            .cold_start(hierarchical_throttle::ColdStart::Exact)
            .key(|k: &String| Some(k.clone()))
            .clock(clock.clone())
            .limit(Limit::per_minute(1_000).build().unwrap())
            .global_store(redis.clone())
            .build()
            .unwrap()
    };
    let chunks = || {
        let frames = (0..10).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![1u8; 100])));
        axum::body::Body::from_stream(futures_util::stream::iter(frames))
    };
    let read = |body: hierarchical_throttle::MeteredBody<axum::body::Body, String>| async move {
        let mut body = std::pin::pin!(body);
        let mut delivered = 0;
        while let Some(Ok(frame)) = body.frame().await {
            delivered += frame.data_ref().map_or(0, |d| d.len());
        }
        delivered
    };
    let (a, b) = (host(), host());
    let (on_a, on_b) = tokio::join!(
        read(a.meter("u1".to_owned(), chunks())),
        read(b.meter("u1".to_owned(), chunks()))
    );
    assert_eq!(
        on_a + on_b,
        1_000,
        "the burst of 1,000 bytes, fleet-wide: {on_a} + {on_b}"
    );
}

/// One script over many buckets defines the bucket arithmetic once and loads each bucket's
/// state in turn: a batch mixing plain, warming-up and calendar buckets (in UTC, at an
/// offset, and in a zone whose offset changes) answers each exactly as a script of its own
/// does, round after round on the same clock, through reservations, debts and releases.
#[tokio::test]
async fn one_script_over_buckets_of_every_kind_answers_each_as_its_own_script_would() {
    use futures_util::StreamExt;
    use hierarchical_throttle::calendar::Period;
    use hierarchical_throttle::global::{Answer, Call};
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = server.store_on(&clock).await;
    let limits = [
        Limit::per_second(100).burst(100).unwrap(),
        Limit::per_second(10)
            .burst(50)
            .unwrap()
            .warm_up(Duration::from_secs(3))
            .unwrap(),
        Limit::per_calendar(40, Period::Day).build().unwrap(),
        Limit::per_calendar(30, Period::Week)
            .utc_offset_minutes(330)
            .build()
            .unwrap(),
        Limit::per_calendar(20, Period::Month)
            .time_zone("Europe/Paris")
            .build()
            .unwrap(),
        Limit::per_hour(7).burst(3).unwrap(),
    ];
    // Round r asks bucket i for a batch that grows with r, reserving up to 2 s ahead, and
    // every third call gives tokens back instead, in odd rounds tokens that expired a second
    // ago (dropped), in others tokens that expire in a second.
    let call = |prefix: &str, round: u64, i: usize, limit: Limit| {
        let key = bucket(&format!("{prefix}-{i}"));
        let expires = match round % 2 {
            1 => clock.now() - Duration::from_secs(1),
            _ => clock.now() + Duration::from_secs(1),
        };
        match (round + i as u64) % 3 {
            2 => Call::Release {
                key,
                limit,
                back: TokenReturn::expiring(round % 4, expires),
            },
            _ => Call::Acquire {
                key,
                limit,
                request: TokenRequest {
                    min: 1,
                    want: 1 + (round * 7 + i as u64) % 25,
                    max_delay: Duration::from_secs(2),
                },
            },
        }
    };
    // Each limit twice in a batch, the second time in reverse order, on buckets of their own:
    // a script names each limit once and its buckets by number.
    let order: Vec<usize> = (0..limits.len()).chain((0..limits.len()).rev()).collect();
    for round in 0..12 {
        let batch: Vec<_> = (order.iter().enumerate())
            .map(|(i, &l)| call("many", round, i, limits[l]))
            .collect();
        let mut batched: Vec<_> = redis.call_many(batch).collect().await;
        batched.sort_by_key(|(i, _)| *i);
        for (i, limit) in order.iter().map(|&l| &limits[l]).enumerate() {
            let alone = match call("one", round, i, *limit) {
                Call::Acquire {
                    key,
                    limit,
                    request,
                } => Answer::Granted(redis.acquire(&key, &limit, request).await.unwrap()),
                Call::Release { key, limit, back } => {
                    redis.release(&key, &limit, back).await.unwrap();
                    Answer::Released
                }
            };
            let in_batch = batched[i].1.as_ref().expect("the batch's script answers");
            assert_eq!(*in_batch, alone, "round {round}, bucket {i} ({limit:?})");
        }
        // On past the hour, the days and, at the end, a month's end.
        clock.advance(Duration::from_secs(1_500 + round * 9_000));
    }
}

/// Slot holds of many keys in one go on a Cluster: one script per node, each node's keys
/// answered as they come, so a stalled primary delays only its own keys; scripts the nodes
/// forgot are sent again where they run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_holds_on_a_stalled_primary_delay_only_its_own_keys() {
    use futures_util::StreamExt;
    use hierarchical_throttle::global::slots::{SlotHold, SlotStore};
    let cluster = RedisCluster::start();
    let redis: RedisGlobalStore<String> = RedisGlobalStore::connect_cluster(cluster.urls())
        .await
        .expect("connect to the test's cluster");
    let keys = one_key_per_primary(&cluster, &redis, "slot-key");
    let holds = |want: u64| {
        let hold = |seq| SlotHold {
            host: 7,
            seq,
            want,
            ttl: Duration::from_secs(10),
        };
        (keys.iter().enumerate())
            .map(|(i, key)| (key.clone(), 2, hold(want * 10 + i as u64)))
            .collect::<Vec<_>>()
    };
    let mut answers: Vec<_> = redis.hold_many(holds(1)).collect().await;
    answers.sort_by_key(|(i, _)| *i);
    for (i, answer) in &answers {
        let holding = answer.as_ref().expect("a healthy cluster answers");
        assert_eq!((holding.held, holding.others), (1, 0), "key {i}");
    }
    for node in &cluster.nodes {
        assert!(node.cli(&["script", "flush"]).contains("OK"));
    }
    cluster.nodes[0].pause();
    let mut answers = std::pin::pin!(redis.hold_many(holds(3)));
    let mut answered = Vec::new();
    for _ in 0..2 {
        let next = tokio::time::timeout(Duration::from_secs(2), answers.next()).await;
        let (i, answer) = next
            .expect("the healthy primaries answer while another is stalled")
            .expect("an answer per key");
        let holding = answer.expect("the script is loaded where it runs");
        assert_eq!(holding.held, 2, "three asked of two: key {i}");
        answered.push(i);
    }
    answered.sort();
    assert_eq!(answered, [1, 2]);
    let stalled = tokio::time::timeout(Duration::from_millis(200), answers.next()).await;
    assert!(stalled.is_err(), "the stalled primary's own key waits");
    cluster.nodes[0].resume();
}

#[tokio::test]
async fn a_stopping_host_hands_back_what_it_holds_on_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    let redis = server.store_on(&clock).await;
    common::stopping::a_stopping_host_hands_back_what_it_holds(&clock, redis).await;
}

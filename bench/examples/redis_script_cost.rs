//! Run with: `REDIS_URL=redis://127.0.0.1:6390 cargo run --release -p hierarchical-throttle-bench --example redis_script_cost`
//! (a `redis-server` of your own, for nothing else; its command statistics are reset).
//!
//! What one bucket of a batch costs Redis: batches of `BATCH` fetches of keys new to Redis go
//! through `RedisGlobalStore::call_many` (one script over the batch), and Redis's own
//! `INFO commandstats` tells the script's microseconds. The anchor, in the same run, is a
//! script that runs, for each key, just the commands a bucket needs (`TIME`, `GET`, `SET … PX`):
//! the ratio is what the bucket's arithmetic and its argument handling add.
//!
//! The client's side too: the CPU time this process spent per key on the crate's batches
//! (making each script's arguments, reading its replies; Linux only, from
//! `/proc/self/task/*/schedstat`), which every host of a fleet pays for its global calls.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use hierarchical_throttle::Limit;
use hierarchical_throttle::global::redis::RedisGlobalStore;
use hierarchical_throttle::global::{Call, GlobalStore, TokenRequest};
use hierarchical_throttle::quota::BucketKey;

type Error = Box<dyn std::error::Error + Send + Sync>;

const BATCH: usize = 14;
/// Batches per measure, unless `SCRIPT_COST_BATCHES` says otherwise (fewer, say, for a Redis
/// run under `valgrind --tool=callgrind`, which counts its instructions;
/// `SCRIPT_COST_ANCHOR=0` then leaves the anchor's batches out of the count).
const BATCHES: usize = 3_000;
const ROUNDS: usize = 3;

/// Per key, the commands a bucket's fetch runs, with its reply's shape, and nothing else.
const COMMANDS_ALONE: &str = r"
local replies = {}
for i = 1, #KEYS do
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
  redis.call('GET', KEYS[i])
  redis.call('SET', KEYS[i], string.format('%.0f %.0f %.0f', 99, 0, now), 'PX',
    string.format('%.0f', 10))
  replies[i] = { 1, 0, 0, 99, 0 }
end
return replies
";

#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL")?;
    let store = RedisGlobalStore::<String>::connect(&url).await?;
    let client = redis::Client::open(url.as_str())?;
    let mut raw = client.get_multiplexed_async_connection().await?;
    let anchor = redis::Script::new(COMMANDS_ALONE);
    let limit = Limit::per_second(100).burst(100)?;
    let mut next_key = 0u64;
    let mut fresh_keys = move || {
        next_key += 1;
        format!("bench-{next_key}")
    };
    let batches: usize = std::env::var("SCRIPT_COST_BATCHES")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(BATCHES);
    // `SCRIPT_COST_ANCHOR=0` leaves the anchor out, so that a Redis under callgrind counts
    // the crate's batches alone.
    let anchor_batches = match std::env::var("SCRIPT_COST_ANCHOR").as_deref() {
        Ok("0") => 0,
        _ => batches,
    };
    println!("batches of {BATCH} keys new to Redis, {batches} per measure; microseconds per key");
    println!("| round | this crate's script | the commands alone | ratio | client CPU per key |");
    println!("|---:|---:|---:|---:|---:|");
    for round in 1..=ROUNDS {
        reset(&mut raw).await?;
        let started = Instant::now();
        let cpu_before = process_cpu_nanos();
        for _ in 0..batches {
            let mut calls = Vec::with_capacity(BATCH);
            for _ in 0..BATCH {
                calls.push(Call::Acquire {
                    key: BucketKey::new(fresh_keys(), "default")?,
                    limit,
                    request: TokenRequest::now(1, 1),
                });
            }
            let answers: Vec<_> = store.call_many(calls).collect().await;
            if let Some((_, Err(error))) = answers.iter().find(|(_, answer)| answer.is_err()) {
                return Err(format!("a call failed: {error}").into());
            }
        }
        let client = match (cpu_before, process_cpu_nanos()) {
            (Some(before), Some(after)) => {
                let per_key = (after - before) as f64 / 1_000.0 / (batches * BATCH) as f64;
                format!("{per_key:.2}")
            }
            _ => "-".to_owned(),
        };
        let ours = per_key(&mut raw, "evalsha").await?;
        let wall = started.elapsed();
        reset(&mut raw).await?;
        for _ in 0..anchor_batches {
            let mut invocation = anchor.prepare_invoke();
            for _ in 0..BATCH {
                invocation.key(fresh_keys());
            }
            let _: redis::Value = invocation.invoke_async(&mut raw).await?;
        }
        let alone = match anchor_batches {
            0 => f64::NAN,
            _ => per_key(&mut raw, "evalsha").await?,
        };
        println!(
            "| {round} | {ours:.2} | {alone:.2} | {:.2}x | {client} |",
            ours / alone.max(f64::MIN_POSITIVE)
        );
        if wall > Duration::from_secs(60) {
            eprintln!("(a round took {wall:?}: is Redis a network hop away?)");
        }
    }
    let _: () = redis::cmd("FLUSHDB").query_async(&mut raw).await?;
    Ok(())
}

/// The CPU time of every thread of this process so far, in nanoseconds (Linux's
/// `/proc/self/task/*/schedstat`); `None` elsewhere.
fn process_cpu_nanos() -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

async fn reset(raw: &mut redis::aio::MultiplexedConnection) -> Result<(), Error> {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(raw)
        .await?;
    Ok(())
}

/// Microseconds per key of the `command` calls since the last reset, from Redis's statistics.
async fn per_key(raw: &mut redis::aio::MultiplexedConnection, command: &str) -> Result<f64, Error> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(raw)
        .await?;
    let prefix = format!("cmdstat_{command}:");
    let line = info
        .lines()
        .find(|line| line.starts_with(&prefix))
        .ok_or_else(|| format!("no {command} in INFO commandstats"))?;
    let field = |name: &str| -> Option<f64> {
        line.split(&[':', ','][..])
            .find_map(|item| item.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
    };
    let (usec, calls) = (field("usec"), field("calls"));
    match (usec, calls) {
        (Some(usec), Some(calls)) if calls > 0.0 => Ok(usec / calls / BATCH as f64),
        _ => Err(format!("unreadable statistics: {line}").into()),
    }
}

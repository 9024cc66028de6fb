//! Run with: cargo run --release -p hierarchical-throttle-bench --example e2e_server -- MODE PORT [LIMIT]
//!
//! The axum app of `examples/axum.rs` (one route, keyed by `x-api-key`), served on
//! 127.0.0.1:PORT in one of six modes, for `scripts/bench-e2e.sh` to load in turn:
//!
//! - `none`: no throttle;
//! - `memory`: this crate with `MemoryGlobalStore`;
//! - `redis`: this crate with `RedisGlobalStore` (`REDIS_URL`), configured as the README's lead
//!   example (a borrowed header key, every other setting its default);
//! - `redis-exact`: the same with `ColdStart::Exact` (no credit: a request this host holds no
//!   tokens for waits for Redis);
//! - `governor`: `tower_governor`, per-host GCRA;
//! - `redis-per-request`: a Redis Lua token bucket asked on every request, as a plain axum
//!   middleware (what the usual Redis rate limiters do).
//!
//! Two knobs of the crate's modes, to compare with their defaults: `E2E_LINGER_US` (another
//! `global_batch_linger`) and `E2E_FIELDS=0` (admitted responses without the `RateLimit`
//! fields).
//!
//! `E2E_SLOW_US=<micros>`, in any mode: every second, on stderr, how many requests took longer
//! than that inside the app (the throttle and the handler, not the sockets or the queue for a
//! worker thread), by status, so that a client's tail latency can be told apart from the app's.
//!
//! Each key's limit is `LIMIT` per second with a burst of `LIMIT` (default: far above the load,
//! to measure what throttling costs, not what it refuses).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hierarchical_throttle::global::redis::RedisGlobalStore;
use hierarchical_throttle::{ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, key};
use http::StatusCode;
use redis::aio::ConnectionManager;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Tokens per second and burst for every mode: far above what the load reaches.
const RATE: u64 = 10_000_000;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "none".into());
    let port: u16 = args.next().unwrap_or_else(|| "3000".into()).parse()?;
    let rate: u64 = args.next().map_or(Ok(RATE), |r| r.parse())?;
    let app = Router::new().route("/", get(|| async { "hello\n" }));
    let redis = || async {
        let url = redis_url()?;
        Ok::<_, Error>(RedisGlobalStore::<key::CompactKey>::connect(&url).await?)
    };
    let app = match mode.as_str() {
        "none" => app,
        "memory" => app.layer(throttle(
            MemoryGlobalStore::new(),
            rate,
            ColdStart::default(),
        )?),
        "redis" => {
            let layer = throttle(redis().await?, rate, ColdStart::default())?;
            if std::env::var_os("E2E_STATS").is_some() {
                let layer = layer.clone();
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        eprintln!("{:?}", layer.stats());
                    }
                });
            }
            app.layer(layer)
        }
        "redis-exact" => app.layer(throttle(redis().await?, rate, ColdStart::Exact)?),
        "governor" => app.layer(governor(rate)?),
        "redis-per-request" => {
            let redis = ConnectionManager::new(redis::Client::open(redis_url()?)?).await?;
            let limiter = Arc::new(PerRequestRedis {
                redis,
                script: redis::Script::new(PER_REQUEST_BUCKET),
                rate,
            });
            app.layer(middleware::from_fn_with_state(limiter, per_request_redis))
        }
        other => return Err(format!("unknown mode {other}").into()),
    };
    let app = match std::env::var("E2E_SLOW_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(slow_us) => count_slow(app, slow_us),
        None => app,
    };
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    println!("serving mode {mode} on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// Requests whose time inside the app passed a threshold: admitted ones, the others, and all.
#[derive(Default)]
struct Slow {
    admitted: std::sync::atomic::AtomicU64,
    refused: std::sync::atomic::AtomicU64,
    all: std::sync::atomic::AtomicU64,
}

/// `app` with the requests slower than `slow_us` inside it counted, and the counts printed
/// every second.
fn count_slow(app: Router, slow_us: u64) -> Router {
    use std::sync::atomic::Ordering::Relaxed;
    let slow = Arc::new(Slow::default());
    let printed = slow.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let [admitted, refused, all] =
                [&printed.admitted, &printed.refused, &printed.all].map(|c| c.load(Relaxed));
            eprintln!("over {slow_us} us inside: {admitted} admitted, {refused} others, of {all}");
        }
    });
    app.layer(middleware::from_fn(move |req: Request, next: Next| {
        let slow = slow.clone();
        async move {
            let started = std::time::Instant::now();
            let response = next.run(req).await;
            slow.all.fetch_add(1, Relaxed);
            if started.elapsed() > std::time::Duration::from_micros(slow_us) {
                let counter = match response.status().is_success() {
                    true => &slow.admitted,
                    false => &slow.refused,
                };
                counter.fetch_add(1, Relaxed);
            }
            response
        }
    }))
}

fn redis_url() -> Result<String, Error> {
    std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL".into())
}

fn throttle<G>(
    global: G,
    rate: u64,
    cold_start: ColdStart,
) -> Result<
    HierarchicalThrottleLayer<Request, key::CompactKey, G>,
    hierarchical_throttle::ConfigError,
>
where
    G: hierarchical_throttle::global::GlobalStore<
            hierarchical_throttle::quota::BucketKey<key::CompactKey>,
        >,
{
    let builder = HierarchicalThrottleLayer::builder()
        .key_ref(|req: &Request| key::header_bytes(req, "x-api-key"))
        .limit(Limit::per_second(rate).burst(rate)?)
        .cold_start(cold_start);
    // E2E_LINGER_US: another `global_batch_linger` than the default, to compare.
    let builder = match std::env::var("E2E_LINGER_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(us) => builder.global_batch_linger(std::time::Duration::from_micros(us)),
        None => builder,
    };
    // E2E_FIELDS=0: admitted responses without the RateLimit fields, to compare.
    let fields = std::env::var("E2E_FIELDS").map_or(true, |v| v != "0");
    builder
        .ratelimit_fields(fields)
        .global_store(global)
        .build()
}

/// tower_governor keyed by the same header.
#[derive(Clone)]
struct ApiKey;

impl KeyExtractor for ApiKey {
    type Key = String;

    fn extract<T>(&self, req: &http::Request<T>) -> Result<String, tower_governor::GovernorError> {
        key::header_value(req, "x-api-key").ok_or(tower_governor::GovernorError::UnableToExtractKey)
    }
}

fn governor(
    rate: u64,
) -> Result<
    GovernorLayer<
        ApiKey,
        governor::middleware::NoOpMiddleware<governor::clock::QuantaInstant>,
        Body,
    >,
    Error,
> {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1_000_000_000 / rate)
        .burst_size(u32::try_from(rate)?)
        .key_extractor(ApiKey)
        .finish()
        .ok_or("invalid governor config")?;
    Ok(GovernorLayer::new(config))
}

/// A classic Redis token bucket, one script call per request: refill by Redis's clock,
/// take one token or refuse.
const PER_REQUEST_BUCKET: &str = r#"
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(state[1]) or burst, tonumber(state[2]) or now
tokens = math.min(burst, tokens + (now - ts) * rate / 1000000)
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1)
return allowed
"#;

struct PerRequestRedis {
    redis: ConnectionManager,
    script: redis::Script,
    rate: u64,
}

async fn per_request_redis(
    State(limiter): State<Arc<PerRequestRedis>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(key) = key::header_value(&req, "x-api-key") else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let mut redis = limiter.redis.clone();
    let allowed: Result<i64, _> = limiter
        .script
        .key(format!("per-request:{{{key}}}"))
        .arg(limiter.rate)
        .arg(limiter.rate)
        .invoke_async(&mut redis)
        .await;
    match allowed {
        Ok(1) => next.run(req).await,
        Ok(_) => StatusCode::TOO_MANY_REQUESTS.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

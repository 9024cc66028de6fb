//! The fleet-wide global store on Redis and Redis Cluster.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, RedisError, Script, ServerErrorKind};

use crate::bucket::expiry_micros;
use crate::clock::{Clock, micros, unix_micros};
use crate::error::ConfigError;
use crate::global::{
    Adjusted, Adjustment, Answer, BucketLevel, Call, GlobalStore, Grant, LayerRegistry,
    TokenRequest, TokenReturn,
};
use crate::limit::Limit;
use crate::quota::BucketKey;

mod batch;
mod keys;
mod slots;

pub use keys::RedisKey;

/// A global store on Redis: one string per bucket (its whole tokens, the fraction of a token,
/// the time it was updated and, with a warm-up, its cold permits: `"7 0 1764320000000000"`),
/// updated atomically by a Lua script that reads **Redis's clock** (`TIME`), so hosts' clocks
/// never matter. A bucket costs Redis one `GET` to read and one `SET` with its expiry to write.
///
/// Every host of a fleet points its layer at the same Redis (or Redis Cluster). A call is one
/// `EVALSHA` (after a restart or a failover, one `EVAL` with the script to the node that serves
/// the key, never to the others). Buckets expire
/// when they would be full again, so idle keys cost Redis no memory. Cloning the store is cheap
/// and shares the connection.
///
/// ```no_run
/// use hierarchical_throttle::global::redis::RedisGlobalStore;
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store: RedisGlobalStore<String> = RedisGlobalStore::connect("redis://127.0.0.1:6379").await?;
/// let cluster: RedisGlobalStore<String> =
///     RedisGlobalStore::connect_cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).await?;
/// # Ok(()) }
/// ```
///
/// # Keys
///
/// The bucket of key `k` for a limit lives at `<prefix>{<k>}:<limit>` (prefix `throttle:` by
/// default; `<limit>` is the limit's name, or `<level>/<limit>` at a further level), with `k`'s
/// bytes percent-encoded except for ASCII letters, digits and `-_.:@`: any key (spaces, braces,
/// newlines, binary) maps to exactly one Redis key, no two keys to the same one, and the braces
/// form a hash tag that keeps each bucket on one cluster slot.
/// [`with_hashed_keys`](Self::with_hashed_keys) writes a keyed hash of the key instead, so
/// that Redis never holds the keys themselves (API keys, client addresses).
pub struct RedisGlobalStore<K> {
    connection: Connection,
    /// Where it connects, for logs (no password).
    location: Arc<str>,
    layers: Arc<LayerRegistry>,
    scripts: Arc<Scripts>,
    prefix: Arc<[u8]>,
    /// The secret keys are hashed with in Redis's key names (`None`: written out).
    hashed_keys: Option<[u8; 16]>,
    now_override: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
    _key: PhantomData<fn(&K)>,
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Lazy(Arc<LazyConnection>),
    Sentinel(Arc<SentinelConnection>),
}

/// The primary of a Redis set watched by Sentinel: found through the sentinels on first use,
/// and found again after any error that says it may have moved (a lost or refused connection,
/// a `READONLY` answer from a primary that has become a replica).
struct SentinelConnection {
    sentinels: tokio::sync::Mutex<redis::sentinel::SentinelClient>,
    primary: std::sync::Mutex<Option<redis::aio::MultiplexedConnection>>,
}

impl SentinelConnection {
    async fn primary(&self) -> Result<redis::aio::MultiplexedConnection, RedisError> {
        if let Some(primary) = crate::sync::lock(&self.primary).clone() {
            return Ok(primary);
        }
        let mut sentinels = self.sentinels.lock().await;
        // Another call may have found it while this one waited.
        if let Some(primary) = crate::sync::lock(&self.primary).clone() {
            return Ok(primary);
        }
        let primary = sentinels.get_async_connection().await?;
        *crate::sync::lock(&self.primary) = Some(primary.clone());
        Ok(primary)
    }

    /// Forgets the primary after `error` if it says the primary may have moved.
    fn after(&self, error: &RedisError) {
        let moved = error.is_io_error()
            || error.is_connection_dropped()
            || error.is_connection_refusal()
            || error.is_timeout()
            || error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly);
        if moved {
            *crate::sync::lock(&self.primary) = None;
        }
    }
}

/// A connection made on first use, and tried again on every use until it is made.
struct LazyConnection {
    client: redis::Client,
    manager: tokio::sync::OnceCell<ConnectionManager>,
}

impl LazyConnection {
    /// The connection, made now if it is not yet: one attempt, so a Redis that is down answers
    /// at once with its error (a refused connection), not with the layer's time-out.
    async fn manager(&self) -> Result<ConnectionManager, RedisError> {
        let manager = self
            .manager
            .get_or_try_init(|| {
                let config = manager_config().set_number_of_retries(0);
                self.client.get_connection_manager_with_config(config)
            })
            .await?;
        Ok(manager.clone())
    }
}

/// A client for `url`; an error that cannot read it echoes it, its password masked.
fn client(url: &str) -> Result<redis::Client, RedisError> {
    redis::Client::open(url).map_err(|error| {
        let detail = format!("`{}`: {error}", masked(url));
        RedisError::from((
            ErrorKind::InvalidClientConfig,
            "unreadable Redis URL",
            detail,
        ))
    })
}

/// `url` with the password of its user part (`scheme://user:password@host`) replaced by `***`.
fn masked(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((user, host)) = rest.split_once('@') else {
        return url.to_owned();
    };
    match user.split_once(':') {
        Some((name, _password)) => format!("{scheme}://{name}:***@{host}"),
        None => url.to_owned(),
    }
}

/// Where `client` connects: its address, without credentials.
fn client_location(client: &redis::Client) -> String {
    format!("redis at {}", client.get_connection_info().addr())
}

/// One retry inside the manager: the throttle has its own time-out, back-off and policy.
fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new().set_number_of_retries(1)
}

struct Scripts {
    acquire: LuaScript,
    many: LuaScript,
    release: LuaScript,
    level: LuaScript,
    adjust: LuaScript,
    slots: LuaScript,
    slots_many: LuaScript,
}

/// A script's source and SHA-1: called by its hash, and sent whole only to a node that does
/// not know it yet.
struct LuaScript {
    source: &'static str,
    hash: String,
}

impl LuaScript {
    fn new(source: &'static str) -> Self {
        Self {
            source,
            hash: Script::new(source).get_hash().to_owned(),
        }
    }
}

/// A script on one bucket: the shared arithmetic, the bucket loaded, then the operation.
macro_rules! bucket_script {
    ($operation:literal) => {
        concat!(
            include_str!("redis/bucket.lua"),
            "load(KEYS, ARGV)\n",
            include_str!($operation)
        )
    };
}

const ACQUIRE: &str = bucket_script!("redis/acquire.lua");
const LEVEL: &str = bucket_script!("redis/level.lua");
const ADJUST: &str = bucket_script!("redis/adjust.lua");
const RELEASE: &str = bucket_script!("redis/release.lua");

impl<K> Clone for RedisGlobalStore<K> {
    fn clone(&self) -> Self {
        Self {
            connection: self.connection.clone(),
            location: self.location.clone(),
            layers: self.layers.clone(),
            scripts: self.scripts.clone(),
            prefix: self.prefix.clone(),
            hashed_keys: self.hashed_keys,
            now_override: self.now_override.clone(),
            _key: PhantomData,
        }
    }
}

impl<K> fmt::Debug for RedisGlobalStore<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.connection {
            Connection::Single(_) => "single",
            Connection::Cluster(_) => "cluster",
            Connection::Lazy(_) => "single, connected on first use",
            Connection::Sentinel(_) => "primary found through Sentinel",
        };
        f.debug_struct("RedisGlobalStore")
            .field("connection", &mode)
            .field("location", &self.location)
            .field("prefix", &String::from_utf8_lossy(&self.prefix))
            // Whether, never the secret.
            .field("hashed_keys", &self.hashed_keys.is_some())
            .finish_non_exhaustive()
    }
}

impl<K> RedisGlobalStore<K> {
    /// Connects to a single Redis (`redis://host:port/db`) through a [`ConnectionManager`],
    /// which reconnects by itself after failures.
    ///
    /// Fails when Redis cannot be reached now; see [`open`](Self::open) for a store that a
    /// service can start with while Redis is down.
    ///
    /// `rediss://` connects with TLS (feature `tls`), verifying the server against the
    /// system's roots; [`connect_client`](Self::connect_client) takes a client built with your
    /// own roots or client certificate. `redis://user:password@host` authenticates.
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Self::connect_client(client(url)?).await
    }

    /// [`connect`](Self::connect) with a client you built, for example with
    /// `redis::Client::build_with_tls` and your own certificate authority.
    pub async fn connect_client(client: redis::Client) -> Result<Self, RedisError> {
        let location = client_location(&client);
        let manager = client
            .get_connection_manager_with_config(manager_config())
            .await?;
        Ok(Self::from_connection_manager(manager).at(location))
    }

    /// A store on a single Redis that connects on first use, not now: a service whose Redis
    /// is down when it starts still starts. Until Redis answers, every call fails at once (a
    /// refused connection), so the layer's failure policy decides and its back-off paces the
    /// attempts; the first call after Redis comes up connects, and decisions move to Redis
    /// without a restart. Only a malformed `url` is an error here.
    ///
    /// ```
    /// use hierarchical_throttle::global::redis::RedisGlobalStore;
    /// // Nothing listens on this port: the store is made all the same.
    /// let store: RedisGlobalStore<String> = RedisGlobalStore::open("redis://127.0.0.1:1")?;
    /// assert!(RedisGlobalStore::<String>::open("not a url").is_err());
    /// # Ok::<(), redis::RedisError>(())
    /// ```
    pub fn open(url: &str) -> Result<Self, RedisError> {
        let client = client(url)?;
        let location = client_location(&client);
        let lazy = Connection::Lazy(Arc::new(LazyConnection {
            client,
            manager: tokio::sync::OnceCell::new(),
        }));
        Ok(Self::new(lazy).at(location))
    }

    /// A store on the primary of the Redis set `service` (Sentinel's `master` name) that the
    /// given sentinels watch (`redis://host:26379` each). Credentials or TLS towards the
    /// primary are set on a [`redis::sentinel::SentinelClient`] given to
    /// [`from_sentinel_client`](Self::from_sentinel_client).
    ///
    /// The primary is asked of the sentinels on first use, not now, so a service starts while
    /// they are unreachable. After a failover, the first call to the old primary fails (the
    /// connection is lost, or it answers `READONLY` as a replica): the layer's failure policy
    /// decides that call's requests, and the next call asks the sentinels for the new primary.
    ///
    /// ```no_run
    /// use hierarchical_throttle::global::redis::RedisGlobalStore;
    /// let store: RedisGlobalStore<String> = RedisGlobalStore::connect_sentinel(
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    ///     "throttle",
    /// )?;
    /// # Ok::<(), redis::RedisError>(())
    /// ```
    pub fn connect_sentinel<I, T>(sentinels: I, service: &str) -> Result<Self, RedisError>
    where
        I: IntoIterator<Item = T>,
        T: redis::IntoConnectionInfo,
    {
        let sentinels: Vec<_> = sentinels
            .into_iter()
            .map(|s| s.into_connection_info())
            .collect::<Result<_, _>>()?;
        let addresses: Vec<String> = sentinels.iter().map(|s| s.addr().to_string()).collect();
        let location = format!("primary `{service}` of sentinels {}", addresses.join(", "));
        let client = redis::sentinel::SentinelClient::build(
            sentinels,
            service.to_owned(),
            None,
            redis::sentinel::SentinelServerType::Master,
        )?;
        Ok(Self::from_sentinel_client(client).at(location))
    }

    /// A store on the primary that an existing Sentinel client finds (for credentials or TLS
    /// towards the primary, set on the client); see [`connect_sentinel`](Self::connect_sentinel).
    pub fn from_sentinel_client(client: redis::sentinel::SentinelClient) -> Self {
        Self::new(Connection::Sentinel(Arc::new(SentinelConnection {
            sentinels: tokio::sync::Mutex::new(client),
            primary: std::sync::Mutex::new(None),
        })))
    }

    /// Connects to a Redis Cluster through any of its nodes.
    pub async fn connect_cluster<I, T>(nodes: I) -> Result<Self, RedisError>
    where
        I: IntoIterator<Item = T>,
        T: redis::IntoConnectionInfo,
    {
        let nodes: Vec<_> = nodes
            .into_iter()
            .map(|n| n.into_connection_info())
            .collect::<Result<_, _>>()?;
        let addresses: Vec<String> = nodes.iter().map(|n| n.addr().to_string()).collect();
        let location = format!("cluster of {}", addresses.join(", "));
        let client = redis::cluster::ClusterClient::new(nodes)?;
        let connection = client.get_async_connection().await?;
        Ok(Self::from_cluster_connection(connection).at(location))
    }

    /// A store on an existing connection manager.
    pub fn from_connection_manager(manager: ConnectionManager) -> Self {
        Self::new(Connection::Single(manager))
    }

    /// A store on an existing cluster connection.
    pub fn from_cluster_connection(connection: ClusterConnection) -> Self {
        Self::new(Connection::Cluster(connection))
    }

    fn new(connection: Connection) -> Self {
        let location = match connection {
            Connection::Cluster(_) => "a Redis Cluster",
            Connection::Sentinel(_) => "a primary found through Sentinel",
            Connection::Single(_) | Connection::Lazy(_) => "a Redis",
        };
        Self {
            location: Arc::from(location),
            layers: Arc::default(),
            connection,
            scripts: Arc::new(Scripts {
                acquire: LuaScript::new(ACQUIRE),
                many: LuaScript::new(batch::MANY),
                release: LuaScript::new(RELEASE),
                level: LuaScript::new(LEVEL),
                adjust: LuaScript::new(ADJUST),
                slots: LuaScript::new(include_str!("redis/slots.lua")),
                slots_many: LuaScript::new(slots::SLOTS_MANY),
            }),
            prefix: Arc::from(&b"throttle:"[..]),
            hashed_keys: None,
            now_override: None,
            _key: PhantomData,
        }
    }

    /// This store, said to be at `location` in logs.
    fn at(mut self, location: String) -> Self {
        self.location = Arc::from(location);
        self
    }

    /// Puts this store's buckets under `prefix` (default `throttle:`), to keep several
    /// deployments apart in one Redis (layers of one deployment are kept apart by their
    /// [names](crate::Builder::name)). A prefix with `{` or `}` is an error: it would change the hash tag.
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, ConfigError> {
        if prefix.contains(['{', '}']) {
            return Err(ConfigError::InvalidSetting {
                setting: "RedisGlobalStore::with_prefix",
                expected: "a prefix without `{` or `}`",
            });
        }
        self.prefix = Arc::from(prefix.as_bytes());
        Ok(self)
    }

    /// Refills by `clock` instead of Redis's `TIME`, for exact tests and simulations only: in
    /// production, hosts' clocks drift, and only Redis's own clock keeps a fleet's limit.
    /// Buckets do not expire in this mode (Redis expires keys in real time).
    pub fn with_clock_override(mut self, clock: impl Clock) -> Self {
        self.now_override = Some(Arc::new(move || unix_micros(&clock)));
        self
    }
}

impl<K: RedisKey> RedisGlobalStore<K> {
    /// Runs `script` on `key`'s node: `EVALSHA`, and `EVAL` with the whole script when that
    /// node does not know it (after a restart or a failover), which also caches it there. The
    /// script is never loaded on other nodes, so a stalled node of a cluster delays only the
    /// keys it serves.
    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        key: &BucketKey<K>,
        limit: &Limit,
        args: [u64; 3],
    ) -> Result<T, RedisError> {
        let redis_key = self.redis_key(key);
        self.eval(script, |cmd| {
            cmd.arg(1).arg(&redis_key);
            write_limit(cmd, limit, self.calendar_shift(limit).as_deref());
            cmd.arg(&args[..]);
        })
        .await
    }

    /// Runs `script` with the keys and arguments `add` puts after it (the test clock's time,
    /// if any, last): `EVALSHA`, and `EVAL` when the node does not know the script.
    async fn eval<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        add: impl Fn(&mut redis::Cmd),
    ) -> Result<T, RedisError> {
        let call = |command: &str, script_arg: &str| {
            let mut cmd = redis::cmd(command);
            cmd.arg(script_arg);
            add(&mut cmd);
            if let Some(now) = &self.now_override {
                cmd.arg(now());
            }
            cmd
        };
        match self.query(&call("EVALSHA", &script.hash)).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.query(&call("EVAL", script.source)).await
            }
            answer => answer,
        }
    }

    /// Whether the store is a Cluster's (a script's keys must then share a slot).
    fn is_cluster(&self) -> bool {
        matches!(self.connection, Connection::Cluster(_))
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, RedisError> {
        match &self.connection {
            Connection::Single(c) => cmd.query_async(&mut c.clone()).await,
            Connection::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            Connection::Lazy(lazy) => cmd.query_async(&mut lazy.manager().await?).await,
            Connection::Sentinel(sentinel) => {
                let answer = cmd.query_async(&mut sentinel.primary().await?).await;
                if let Err(error) = &answer {
                    sentinel.after(error);
                }
                answer
            }
        }
    }
}

/// A key's call that failed inside a batch script (its key holds another type of value, or a
/// string that is no bucket's), marked -1 in the script's reply; it wrote nothing, so it is a
/// server error, never applied.
fn failed_in_script() -> RedisError {
    RedisError::from((
        ErrorKind::Server(ServerErrorKind::ResponseError),
        "this key's call failed in the batch script",
        "the key may hold something other than a bucket".to_owned(),
    ))
}

/// A limit as every bucket script reads it, `ARGV[1]` to `ARGV[6]`: capacity, refill amount
/// and period, most cold permits, calendar period, and `shift`, a calendar quota's resets'
/// distance from midnight UTC (`None`: `0`).
fn write_limit(cmd: &mut redis::Cmd, limit: &Limit, shift: Option<&str>) {
    cmd.arg(limit.capacity())
        .arg(limit.refill_amount())
        .arg(limit.period_micros())
        .arg(limit.cold_max())
        .arg(calendar_code(limit))
        .arg(shift.unwrap_or("0"));
}

/// A calendar quota's period as the scripts number it (0: a limit that refills at a rate).
fn calendar_code(limit: &Limit) -> u8 {
    limit.calendar().map_or(0, |c| c.code())
}

impl<K> RedisGlobalStore<K> {
    /// A calendar quota's resets' distance from midnight UTC, as the scripts read it (see
    /// `Calendar::script_shift`), for a call made now; `None` for a limit that refills at a
    /// rate (the scripts then read `0`).
    fn calendar_shift(&self, limit: &Limit) -> Option<String> {
        let calendar = limit.calendar()?;
        Some(calendar.script_shift(|| {
            match &self.now_override {
                Some(now) => now(),
                None => std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, micros),
            }
        }))
    }
}

impl<K> GlobalStore<BucketKey<K>> for RedisGlobalStore<K>
where
    K: RedisKey + Send + Sync + 'static,
{
    type Error = RedisError;

    async fn acquire(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
        request: TokenRequest,
    ) -> Result<Grant, RedisError> {
        let (granted, reserved, ready_in, remaining, refill_in): (u64, u64, u64, u64, u64) = self
            .run(
                &self.scripts.acquire,
                key,
                limit,
                [request.min, request.want, micros(request.max_delay)],
            )
            .await?;
        Ok(Grant {
            granted,
            reserved,
            ready_in: Duration::from_micros(ready_in),
            remaining,
            refill_in: Duration::from_micros(refill_in),
        })
    }

    async fn release(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
        back: TokenReturn,
    ) -> Result<(), RedisError> {
        let args = [back.tokens, back.expires_micros(), 0];
        let _held: u64 = self.run(&self.scripts.release, key, limit, args).await?;
        Ok(())
    }

    async fn level(&self, key: &BucketKey<K>, limit: &Limit) -> Result<BucketLevel, RedisError> {
        let level = self.run(&self.scripts.level, key, limit, [0, 0, 0]).await?;
        Ok(bucket_level(level))
    }

    async fn adjust(
        &self,
        key: &BucketKey<K>,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> Result<Adjusted, RedisError> {
        // Beyond twice the capacity, a removal only reaches the floor of a capacity of debt;
        // kept below 2^54 so that Lua's doubles stay exact enough.
        let most = limit.capacity().saturating_mul(2);
        let (op, tokens) = match adjustment {
            Adjustment::Reset => (0, 0),
            Adjustment::Drain => (1, 0),
            Adjustment::Add(n) => (2, n.min(most)),
            Adjustment::Remove(n) => (3, n.min(most)),
        };
        let args = [op, tokens, expiry_micros(expires)];
        let (tokens, next_in, full_in, applied): (u64, u64, u64, u8) =
            self.run(&self.scripts.adjust, key, limit, args).await?;
        Ok(Adjusted {
            level: bucket_level((tokens, next_in, full_in)),
            applied: applied == 1,
        })
    }

    /// One script per node (on a Cluster, per hash tag, all at once) for all the calls' buckets.
    fn call_many(
        &self,
        calls: Vec<Call<BucketKey<K>>>,
    ) -> impl Stream<Item = (usize, Result<Answer, RedisError>)> + Send
    where
        BucketKey<K>: Send + Sync,
    {
        self.run_batch(calls)
    }

    fn layers(&self) -> Option<&LayerRegistry> {
        Some(&self.layers)
    }

    fn location(&self) -> String {
        self.location.to_string()
    }

    /// A refused connection, an error reply (the scripts write only once they cannot fail) or
    /// a command the client never sent did not change the bucket; a lost connection or an
    /// unreadable answer may have. Redis refuses a script's writes for want of memory only
    /// until the script has written, and for want of a disk or of replicas on a state that
    /// cannot change while a script runs: such a refusal comes at the first write.
    fn may_have_applied(&self, error: &RedisError) -> bool {
        let never_ran = error.is_connection_refusal()
            || matches!(
                error.kind(),
                ErrorKind::Server(_)
                    | ErrorKind::Client
                    | ErrorKind::InvalidClientConfig
                    | ErrorKind::AuthenticationFailed
                    | ErrorKind::ClusterConnectionNotFound
            )
            || matches!(error.code(), Some("OOM" | "MISCONF" | "NOREPLICAS"));
        !never_ran
    }
}

/// A level as `level.lua` and `adjust.lua` return it: whole tokens, microseconds until one
/// more, microseconds until full.
fn bucket_level((tokens, next_in, full_in): (u64, u64, u64)) -> BucketLevel {
    BucketLevel {
        tokens,
        next_in: Duration::from_micros(next_in),
        full_in: Duration::from_micros(full_in),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_url_is_echoed_with_its_password_masked() {
        let error = RedisGlobalStore::<String>::open("redis://app:s3cret@127.0.0.1:port/0")
            .expect_err("a bad port is an error")
            .to_string();
        assert!(
            error.contains("redis://app:***@127.0.0.1:port/0"),
            "{error}"
        );
        assert!(!error.contains("s3cret"), "{error}");
        assert_eq!(masked("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(masked("rediss://:pw@h:1"), "rediss://:***@h:1");
    }
}

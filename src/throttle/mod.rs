//! The engine shared by a layer and all its services: it reads the clock, calls the global store
//! and delivers what each key's lease state machine ([`LocalBucket`](crate::local::LocalBucket))
//! decides.
//!
//! Hot path: one local-store lookup and a subtraction. Slow path (the lease is short): read the
//! clock, then refuse at once if the global bucket is known to be short, or queue for the single
//! fetch in flight for the key on this host. A fetch runs in a task of its own and decides every
//! request queued for it; whatever ends that task (an answer, a time-out, a panic, a cancelled
//! task, a dropped runtime) settles the key, so no key is ever left waiting on a fetch that will
//! not finish. Nothing is spawned and no user code runs while a local-store lock is held.
//!
//! This floor is the engine: it uses the model, the lease state machine and the stores below
//! it, and returns plain decisions ([`Check`], [`Admitted`], a [`Rejection`] with its reason,
//! limit and wait). It knows nothing of HTTP, gRPC or tower: the answers and the tower surface
//! above it turn those decisions into responses. Every `impl Throttle` block lives here, one
//! role per file: `check` (a request on one bucket), `admission` (all or nothing over several),
//! `fetch` (batches, one per key and host), `health` (back-off and the failure policy),
//! `sweeper` and `hand_backs` (tokens back to the store), `resets` (calendar quotas'
//! windows), `refusal`, `settle` (costs from responses), `shaping` (waits), `views`, and `key`
//! (reading a request's key).

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::batch::BatchPolicy;
use crate::clock::{Clock, micros};
use crate::failure::FailurePolicy;
use crate::global::GlobalStore;
use crate::limit::Limit;
use crate::local::LocalStore;
use crate::quota::{BucketKey, LeaseKey, Name, Quota};
use crate::rejection::Rejection;
use crate::stats::Stats;

mod adjust;
mod admission;
mod calls;
mod check;
mod fetch;
mod hand_backs;
mod health;
mod refusal;
mod resets;
mod sweeper;

pub(crate) use fetch::TimedOut;
use health::StoreHealth;
use refusal::Jitter;
pub(crate) mod key;
mod settle;
pub(crate) use settle::{Admission, Corrected, LimitStates, OneLimitState};
pub(crate) use views::Viewed;
pub(crate) mod shaping;
mod views;

/// The decision for one request.
pub(crate) enum Check<K> {
    /// Admitted with leased tokens.
    Admit,
    // Boxed, so that an admission (the common case) is a small value, returned in registers
    // through the hot path's calls rather than copied.
    Reject(Box<Rejection<K>>),
    /// Decided later (after a batch), or by the failure policy (a ready future: rare).
    Wait(Decision<K>),
}

/// A decision that comes later.
pub(crate) type Decision<K> = BoxFuture<'static, Result<Admitted, Rejection<K>>>;

/// How a use of a key was admitted: from tokens leased by the global store, or, on some of
/// its buckets, by the [`FailurePolicy`] while the store could not be asked. It travels with
/// the use, so that settling it never refunds into a lease tokens the lease never gave.
///
/// Returned by [`HierarchicalThrottleLayer::acquire`](crate::HierarchicalThrottleLayer::acquire)
/// and handed back to [`settle`](crate::HierarchicalThrottleLayer::settle).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admitted {
    /// Bit `level * 16 + slot` set for each bucket the failure policy decided.
    by_policy: u128,
    /// Bit `level * 16 + slot` set for each bucket of a limit in shadow that would have
    /// refused: it took nothing.
    untaken: u128,
    /// Admitted in shadow mode: it took nothing, and has nothing to settle.
    shadow: bool,
    /// When it was admitted (the throttle's Unix microseconds; 0: not known), for calendar
    /// quotas: a refund after their reset goes nowhere.
    at: u64,
}

impl Admitted {
    /// Every bucket admitted with leased tokens.
    pub(crate) const LEASED: Self = Self {
        by_policy: 0,
        untaken: 0,
        shadow: false,
        at: 0,
    };

    /// Every bucket admitted with leased tokens, at `at` (0: not known).
    pub(crate) fn leased_at(at: u64) -> Self {
        Self { at, ..Self::LEASED }
    }

    /// Served in shadow mode instead of refused.
    pub(crate) const SHADOW: Self = Self {
        by_policy: u128::MAX,
        untaken: 0,
        shadow: true,
        at: 0,
    };

    /// Bucket `id` admitted by the failure policy.
    fn by_policy<K>(id: &LeaseKey<K>) -> Self {
        Self {
            by_policy: 1 << Self::bit(id.level, id.slot),
            ..Self::LEASED
        }
    }

    /// Bucket `id`, of a limit in shadow, would have refused: it took nothing.
    fn untaken<K>(id: &LeaseKey<K>) -> Self {
        Self {
            untaken: 1 << Self::bit(id.level, id.slot),
            ..Self::LEASED
        }
    }

    fn bit(level: u8, slot: u8) -> u32 {
        (u32::from(level) * 16 + u32::from(slot)).min(127)
    }

    /// The buckets of both (admitted at the earlier time known).
    pub(crate) fn and(self, other: Self) -> Self {
        Self {
            by_policy: self.by_policy | other.by_policy,
            untaken: self.untaken | other.untaken,
            shadow: self.shadow || other.shadow,
            at: match (self.at, other.at) {
                (0, at) | (at, 0) => at,
                (a, b) => a.min(b),
            },
        }
    }

    /// Admitted at `now` (the throttle's Unix microseconds).
    pub(crate) fn at(self, now: u64) -> Self {
        Self {
            at: now.max(1),
            ..self
        }
    }

    /// When it was admitted (0: not known).
    pub(crate) fn admitted_at(&self) -> u64 {
        self.at
    }

    /// Whether it was served in shadow mode, taking nothing.
    pub(crate) fn in_shadow(&self) -> bool {
        self.shadow
    }

    /// Buckets the failure policy decided (none in shadow mode, which took nothing).
    fn policy_buckets(&self) -> u32 {
        match self.shadow {
            true => 0,
            false => self.by_policy.count_ones(),
        }
    }

    /// Whether every bucket the use drew on admitted it with leased tokens (`false` when the
    /// failure policy decided any of them, or a limit in [shadow](crate::Builder::shadow_limit)
    /// let it through: a refund then goes nowhere on those).
    pub fn from_leases(&self) -> bool {
        self.by_policy | self.untaken == 0
    }

    /// Whether the bucket at `level` and `slot` admitted it with leased tokens.
    pub(crate) fn leased(&self, level: u8, slot: u8) -> bool {
        (self.by_policy | self.untaken) & (1 << Self::bit(level, slot)) == 0
    }
}

impl<K> Check<K> {
    pub(crate) fn reject(rejection: Rejection<K>) -> Self {
        Self::Reject(Box::new(rejection))
    }
}

/// An admission decided already, but not from leased tokens on every bucket (the failure
/// policy, a limit in shadow): a ready decision that carries which.
impl<K: Send + 'static> From<Admitted> for Check<K> {
    fn from(admitted: Admitted) -> Self {
        Self::Wait(Box::pin(std::future::ready(Ok(admitted))))
    }
}

/// A level of keys: its name (none for the layer's first) and where its keys' quotas come
/// from.
pub(crate) struct Level<K> {
    pub(crate) name: Option<Name>,
    pub(crate) quota: QuotaSource<K>,
}

pub(crate) enum QuotaSource<K> {
    Fixed(Quota),
    PerKey(Box<dyn Fn(&K) -> Quota + Send + Sync>),
}

/// A bucket's limit and names, looked up from its key's quota.
#[derive(Clone, Copy)]
pub(crate) struct Resolved {
    pub(crate) limit: Limit,
    pub(crate) name: Name,
    pub(crate) level: Option<Name>,
    /// How many limits the key's quota has.
    pub(crate) slots: u8,
    /// The limit is in shadow: its refusals are counted, never made.
    pub(crate) shadow: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) store_timeout: Duration,
    pub(crate) lease_ttl: Duration,
    /// How long a host refuses a key from one answer before asking the store again (`None`:
    /// the lease time-to-live).
    pub(crate) refusal_memory: Option<Duration>,
    pub(crate) demand_interval: Duration,
    pub(crate) demand_intervals: usize,
    pub(crate) failure_policy: FailurePolicy,
    pub(crate) max_backoff: Duration,
    pub(crate) max_reservation: Duration,
    /// The most global calls sent to the store in one batch.
    pub(crate) global_batch: usize,
    /// How long a call nothing waits on may wait for others to join its batch.
    pub(crate) global_batch_linger: Duration,
    /// Whether a request the lease cannot serve may be admitted on credit.
    pub(crate) cold_start: crate::credit::ColdStart,
    /// Whether a key far from its limit is leased at least a sixteenth of its capacity at a
    /// time, kept for up to ten lease times-to-live unused.
    pub(crate) keep_small_leases: bool,
    pub(crate) shadow: bool,
    /// What the `RateLimit` fields say, and whether admitted responses get them (when the
    /// rejection handler writes them).
    pub(crate) fields: crate::fields::RateLimitFields,
    /// Whether requests may cost other than one token (a cost closure, settled costs): their
    /// limits' unit is then `tokens`, unless named.
    pub(crate) costs_vary: bool,
    /// Whether throttled requests wait for their tokens.
    pub(crate) shaping: shaping::Shaping,
    /// The most added at random to a refusal's `retry_after`.
    pub(crate) retry_jitter: Duration,
    /// The layer's name, a label on its metrics.
    pub(crate) name: std::sync::Arc<str>,
    /// The layer's name in its global buckets' identities.
    pub(crate) layer: Name,
    /// Limits in shadow: a level (`None`: the first) and a limit (`None`: every one of it).
    pub(crate) shadow_limits: Vec<(Option<Name>, Option<Name>)>,
}

impl Config {
    /// The layer's name for clients, when it was named.
    pub(crate) fn layer_name(&self) -> Option<&'static str> {
        let name = self.layer.as_str();
        (name != crate::quota::DEFAULT_LAYER).then_some(name)
    }

    /// Whether limit `name` at `level` is in shadow.
    pub(crate) fn in_shadow(&self, level: Option<Name>, name: Name) -> bool {
        self.shadow_limits
            .iter()
            .any(|&(l, n)| l == level && n.is_none_or(|n| n == name))
    }

    /// The quota unit of limit `name` at `level`.
    pub(crate) fn unit(&self, level: Option<&str>, name: &str) -> &'static str {
        self.fields.unit_of_limit(level, name, self.costs_vary)
    }
}

/// What a throttle key must be: hashed, compared, cloned into tasks.
pub(crate) trait Key: std::hash::Hash + Eq + Clone + Send + Sync + 'static {}

impl<T: std::hash::Hash + Eq + Clone + Send + Sync + 'static> Key for T {}

/// A global store of a key's buckets.
pub(crate) trait Global<K>: GlobalStore<BucketKey<K>> {}

impl<K, G: GlobalStore<BucketKey<K>>> Global<K> for G {}

/// A local store of a key's leases.
pub(crate) trait Local<K>: LocalStore<LeaseKey<K>> {}

impl<K, L: LocalStore<LeaseKey<K>>> Local<K> for L {}

/// The longest duration any setting accepts: longer ones are configuration errors, so no time
/// arithmetic can overflow at request time.
pub(crate) const MAX_SETTING: Duration = Duration::from_secs(3600);

pub(crate) struct Throttle<K, G, L, C> {
    pub(crate) global: G,
    pub(crate) local: L,
    pub(crate) clock: C,
    pub(crate) levels: Box<[Level<K>]>,
    pub(crate) batch: Box<dyn BatchPolicy>,
    pub(crate) config: Config,
    pub(crate) stats: Stats,
    /// Reservations admitted at once (counted among the requests admitted) and then dropped
    /// unused: taken off the count.
    pub(crate) requests_withdrawn: crate::stats::Counter,
    pub(crate) health: StoreHealth,
    sweeper_running: AtomicBool,
    /// Whether this host has leased a calendar quota's tokens: admissions then carry their
    /// time.
    leases_calendar_quotas: AtomicBool,
    jitter: Jitter,
    pub(crate) refusals: crate::stats::RefusalsByLimit,
    /// Requests waiting for a batch at the last sweep.
    pub(crate) waiting_for_batches: AtomicU64,
    pub(crate) shaper: Arc<shaping::Shaper<K>>,
    /// Global calls waiting for the next batch.
    calls: calls::GlobalCalls<K>,
    /// Tokens on their way back to the store: kept for the next sweep (evicted leases, and
    /// hand-backs the store did not take), or out.
    hand_backs: hand_backs::HandBacks<K>,
    /// The fetch tasks under way, each with the credit charge that may follow its answer.
    fetches: crate::sync::UnderWay,
    /// When a request without a key was last logged at warn (clock micros; 0: never).
    missing_key_warned_at: AtomicU64,
    /// Where the global store is, for logs.
    store_location: String,
    /// Keeps this layer's name registered with its global store while it lives.
    pub(crate) registration: Option<Arc<()>>,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    pub(crate) fn new(
        global: G,
        local: L,
        clock: C,
        levels: Box<[Level<K>]>,
        batch: Box<dyn BatchPolicy>,
        config: Config,
    ) -> Self {
        Self {
            local,
            clock,
            levels,
            batch,
            config,
            stats: Stats::default(),
            requests_withdrawn: Default::default(),
            health: StoreHealth::default(),
            sweeper_running: AtomicBool::new(false),
            leases_calendar_quotas: AtomicBool::new(false),
            jitter: Jitter::default(),
            refusals: crate::stats::RefusalsByLimit::default(),
            waiting_for_batches: AtomicU64::new(0),
            shaper: Arc::default(),
            calls: calls::GlobalCalls::default(),
            hand_backs: hand_backs::HandBacks::default(),
            fetches: crate::sync::UnderWay::default(),
            missing_key_warned_at: AtomicU64::new(0),
            store_location: global.location(),
            registration: None,
            global,
        }
    }

    /// The index of the further level called `name`.
    pub(crate) fn level_named(&self, name: &str) -> Option<u8> {
        let index = self
            .levels
            .iter()
            .position(|level| level.name.is_some_and(|n| n.as_str() == name))?;
        u8::try_from(index).ok()
    }

    pub(crate) fn quota(&self, level: u8, key: &K) -> Option<Quota> {
        Some(self.level_quota(level, key)?.1.into_owned())
    }

    /// The name of `level` and the quota of `key` there: borrowed when it is the same for
    /// every key, so reading it costs no reference count.
    pub(crate) fn level_quota(
        &self,
        level: u8,
        key: &K,
    ) -> Option<(Option<Name>, std::borrow::Cow<'_, Quota>)> {
        let level = self.levels.get(usize::from(level))?;
        let quota = match &level.quota {
            QuotaSource::Fixed(quota) => std::borrow::Cow::Borrowed(quota),
            QuotaSource::PerKey(f) => std::borrow::Cow::Owned(f(key)),
        };
        Some((level.name, quota))
    }

    /// The limit and names of bucket `id`; `None` if its key's quota no longer has that limit.
    pub(crate) fn resolve(&self, id: &LeaseKey<K>) -> Option<Resolved> {
        // Borrowed: a quota the same for every key is read without a reference count.
        let (level, quota) = self.level_quota(id.level, &id.key)?;
        let (name, limit) = quota.slot(id.slot)?;
        Some(Resolved {
            limit,
            name,
            level,
            slots: quota.slots(),
            shadow: self.config.in_shadow(level, name),
        })
    }

    pub(crate) fn global_key(&self, id: &LeaseKey<K>, limit: Name) -> BucketKey<K> {
        let level = self.levels.get(usize::from(id.level)).and_then(|l| l.name);
        BucketKey::from_parts(id.key.clone(), self.config.layer, level, limit)
    }

    /// The time now, on the calendar (Unix microseconds): calendar quotas reset by it.
    pub(crate) fn now(&self) -> u64 {
        crate::clock::unix_micros(&self.clock)
    }

    /// The clock's recent time on the calendar: what a response tells is read at it.
    pub(crate) fn recent(&self) -> u64 {
        crate::clock::unix_recent_micros(&self.clock)
    }

    fn interval(&self, now: u64) -> u64 {
        now / micros(self.config.demand_interval).max(1)
    }
}

/// Keys appear in traces only hashed, with a fixed seed so that one key's hash is the same on
/// every host: a key can be followed without being shown.
static KEY_HASH: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0x7468_726f);

impl Resolved {
    /// A fingerprint of the limit's name and shape.
    fn shape(&self) -> u32 {
        KEY_HASH.hash_one((self.name, self.level, self.limit)) as u32
    }
}

//! The concurrency engine: each key's slots on this host ([`SlotLease`]), the slot store's
//! calls around them, and the sweeper that renews holdings and gives idle slots back. Plain
//! decisions, no HTTP: [`HierarchicalConcurrency`](crate::HierarchicalConcurrency) sits on it.

mod batch;
mod calls;
mod permit;
mod sweeper;

use std::hash::{BuildHasher, Hash};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use hashbrown::HashTable;

use crate::clock::{Clock, Now, micros};
use crate::credit::ColdStart;
use crate::global::slots::SlotStore;
use crate::quota::{BucketKey, Name};
use crate::slots::{SlotLease, TryTake};
use crate::sync::{ShardLock, UnderWay, key_hasher, shard_index};

use permit::Engine;
pub(crate) use permit::Entry;
pub use permit::SlotPermit;
pub(crate) use permit::WaitForSlot;

const SHARD_BITS: u32 = 6;

/// What a request waiting for the store is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Admitted,
    Full,
    Unavailable,
}

type Waiter = tokio::sync::oneshot::Sender<Verdict>;
/// One of the engine's shards: keys and their slot leases, and the requests admitted at once
/// (counted under the lock the admission takes anyway, not with an atomic of its own).
struct Shard<K> {
    keys: HashTable<(K, Arc<Entry>)>,
    admitted: u64,
}

/// Why a request got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoSlot {
    /// The key's slots are all in use, fleet-wide.
    Full,
    /// The slot store failed and the failure policy refuses.
    Unavailable,
}

/// A key's concurrency limit, read on every call to the store for it (so it may differ per
/// key and change at run time).
pub(crate) type MaxFn<K> = Arc<dyn Fn(&K) -> u64 + Send + Sync>;

/// What a host admits on its own while the store fails, out of a key's limit.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fallback {
    All,
    None,
    ShareOf(std::num::NonZeroU64),
}

impl Fallback {
    pub(crate) fn cap(self, max: u64) -> u64 {
        match self {
            Self::All => u64::MAX,
            Self::None => 0,
            Self::ShareOf(hosts) => max.div_ceil(hosts.get()),
        }
    }
}

/// The engine's settings, checked by the builder.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) layer: Name,
    pub(crate) name: Name,
    pub(crate) fallback: Fallback,
    /// What a key not known to be full may have in flight beyond its holding, per host.
    pub(crate) cold_start: ColdStart,
    pub(crate) slot_ttl: Duration,
    pub(crate) linger: Duration,
    pub(crate) store_timeout: Duration,
    /// The most slot calls in one round trip.
    pub(crate) store_batch: usize,
    pub(crate) back_off: Duration,
    pub(crate) host: u64,
    /// Lays keys out by this seed's hash rather than a random one (reproducible runs).
    pub(crate) hash_seed: Option<u64>,
    /// How long a request may wait for a slot when the fleet is full (`None`: refused).
    pub(crate) max_wait: Option<Duration>,
}

/// Counters of a concurrency layer, shared by its clones (those admitted at once are counted
/// by shard).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Admitted after waiting for the store.
    pub(crate) admitted: AtomicU64,
    /// Admitted at once on credit (counted in the admitted by shard too).
    pub(crate) on_credit: AtomicU64,
    pub(crate) refused_full: AtomicU64,
    pub(crate) refused_unavailable: AtomicU64,
    pub(crate) store_calls: AtomicU64,
    /// Batches of calls sent to the store (one round trip each).
    pub(crate) store_round_trips: AtomicU64,
    pub(crate) store_failures: AtomicU64,
    /// Requests exempt from the limit, passed through without a slot.
    pub(crate) exempt: AtomicU64,
    /// Requests served without a slot in place of their refusal (shadow mode).
    pub(crate) shadow_admitted: AtomicU64,
}

/// The engine. Cloning shares it.
pub(crate) struct InFlight<K, S, C> {
    shared: Arc<Shared<K, S, C>>,
}

impl<K, S, C> Clone for InFlight<K, S, C> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

pub(crate) struct Shared<K, S, C> {
    shards: Box<[ShardLock<Shard<K>>]>,
    hasher: foldhash::fast::SeedableRandomState,
    store: S,
    calls: batch::SlotCalls<K>,
    clock: C,
    settings: Settings,
    max: MaxFn<K>,
    seq: AtomicU64,
    sweeper_running: AtomicBool,
    /// Keys' call tasks under way.
    calls_under_way: UnderWay,
    pub(crate) counters: Counters,
}

/// What [`InFlight::try_acquire`] found.
pub(crate) enum Acquired {
    Now(SlotPermit),
    Wait(WaitForSlot),
    Refused(NoSlot),
}

impl<K, S, C> InFlight<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    pub(crate) fn new(store: S, clock: C, settings: Settings, max: MaxFn<K>) -> Self {
        // Calls are numbered from the time on the calendar, so a host restarted with the same
        // identity still numbers its calls above those of its previous life.
        let first_seq = crate::clock::unix_micros(&clock);
        let shards = (0..1 << SHARD_BITS)
            .map(|_| {
                ShardLock::new(Shard {
                    keys: HashTable::new(),
                    admitted: 0,
                })
            })
            .collect();
        Self {
            shared: Arc::new(Shared {
                shards,
                hasher: key_hasher(settings.hash_seed),
                store,
                calls: batch::SlotCalls::default(),
                clock,
                settings,
                max,
                seq: AtomicU64::new(first_seq),
                sweeper_running: AtomicBool::new(false),
                calls_under_way: UnderWay::default(),
                counters: Counters::default(),
            }),
        }
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.shared.settings
    }

    /// `key`'s concurrency limit now.
    pub(crate) fn max_for(&self, key: &K) -> u64 {
        (self.shared.max)(key)
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// A slot for `key` now if this host has a free one, else the wait for the store's
    /// answer. Must run on a Tokio runtime: the store's calls are spawned, so a request that
    /// goes away never strands the others waiting on its call.
    pub(crate) fn try_acquire(&self, key: &K) -> Acquired {
        self.shared.ensure_sweeper();
        let shared = &self.shared;
        let mut now = shared.now_to_ask();
        let hash = shared.hasher.hash_one(key);
        let mut shard = shared.shards[shard_index(hash, SHARD_BITS)].lock();
        let entry = match shard.keys.find(hash, |(k, _)| k == key) {
            Some((_, entry)) => entry.clone(),
            None => {
                let max = (shared.max)(key);
                let (cap, credit) = (shared.settings.fallback.cap(max), shared.credit(max));
                let lease = SlotLease::new(cap, credit, shared.settings.max_wait.is_some());
                let engine: std::sync::Weak<dyn Engine> = Arc::downgrade(shared) as _;
                let entry = Arc::new(Entry::new(lease, engine));
                let rehash = |(k, _): &(K, Arc<Entry>)| shared.hasher.hash_one(k);
                shard
                    .keys
                    .insert_unique(hash, (key.clone(), entry.clone()), rehash);
                entry
            }
        };
        // The shard stays locked while the key's lease is, so the sweeper never forgets a
        // lease a request is about to use.
        let mut lease = entry.lease.lock();
        let taken = lease.try_take(&mut now);
        let (sender, receiver) = match taken {
            TryTake::Taken | TryTake::Fallback { admitted: true } => {
                drop(lease);
                shard.admitted += 1;
                drop(shard);
                return Acquired::Now(SlotPermit::new(entry));
            }
            TryTake::OnCredit => {
                let call = lease.ask(now.exact(), || shared.next_seq());
                drop(lease);
                shard.admitted += 1;
                drop(shard);
                shared.counters.on_credit.fetch_add(1, Ordering::Relaxed);
                if let Some(call) = call {
                    calls::spawn(shared.clone(), key.clone(), entry.clone(), call);
                }
                return Acquired::Now(SlotPermit::new(entry));
            }
            TryTake::Fallback { admitted: false } => {
                shared
                    .counters
                    .refused_unavailable
                    .fetch_add(1, Ordering::Relaxed);
                return Acquired::Refused(NoSlot::Unavailable);
            }
            TryTake::MustWait => tokio::sync::oneshot::channel(),
        };
        // A waiter's arrival is ordered against the call's sending: the time read exactly.
        let call = lease.wait(sender, now.exact(), || shared.next_seq());
        drop(lease);
        drop(shard);
        if let Some(call) = call {
            calls::spawn(shared.clone(), key.clone(), entry.clone(), call);
        }
        let deadline = shared.settings.max_wait;
        Acquired::Wait(WaitForSlot::new(entry, receiver, deadline))
    }

    /// Gives back every slot this host holds beyond its requests in flight, once the calls
    /// under way have ended, and returns once the store has answered (each wait at most two
    /// store time-outs): for a host about to stop.
    pub(crate) async fn return_all_slots(&self) {
        let shared = &self.shared;
        let within = shared.settings.store_timeout * 2;
        let _ = tokio::time::timeout(within, shared.calls_under_way.none_left()).await;
        let now = shared.now();
        let mut calls = Vec::new();
        for shard in shared.shards.iter() {
            let shard = shard.lock();
            for (key, entry) in shard.keys.iter() {
                let call = entry
                    .lease
                    .lock()
                    .give_back_unused(now, || shared.next_seq());
                if let Some(call) = call {
                    calls.push((key.clone(), entry.clone(), call));
                }
            }
        }
        for (key, entry, call) in calls {
            calls::spawn(shared.clone(), key, entry, call);
        }
        let _ = tokio::time::timeout(within, shared.calls_under_way.none_left()).await;
    }

    /// Counts a request exempt from the limit.
    pub(crate) fn count_exempt(&self) {
        self.shared.counters.exempt.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request served without a slot in place of its refusal (shadow mode).
    pub(crate) fn count_shadow_admitted(&self) {
        self.shared
            .counters
            .shadow_admitted
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The permit of a request served without a slot in place of its refusal (shadow mode),
    /// counted.
    pub(crate) fn shadow_permit(&self) -> SlotPermit {
        self.count_shadow_admitted();
        SlotPermit::unheld()
    }

    /// Requests admitted so far: at once (counted by shard) and after a wait.
    pub(crate) fn admitted(&self) -> u64 {
        let at_once: u64 = self.shared.shards.iter().map(|s| s.lock().admitted).sum();
        at_once + self.shared.counters.admitted.load(Ordering::Relaxed)
    }

    /// Keys this host keeps slot state for.
    pub(crate) fn keys(&self) -> usize {
        self.shared.shards.iter().map(|s| s.lock().keys.len()).sum()
    }

    /// Requests in flight on this host, over all keys.
    pub(crate) fn in_flight(&self) -> u64 {
        self.shared
            .shards
            .iter()
            .map(|s| {
                s.lock()
                    .keys
                    .iter()
                    .map(|(_, e)| e.lease.lock().in_use())
                    .sum::<u64>()
            })
            .sum()
    }
}

impl<K, S, C> Shared<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    fn now(&self) -> u64 {
        micros(self.clock.now())
    }

    /// The time for a request's questions: the clock's recent reading, read again exactly
    /// only near an edge.
    fn now_to_ask(&self) -> Now<impl FnMut() -> u64 + '_> {
        let lag = micros(self.clock.recent_lag());
        Now::new(micros(self.clock.recent()), lag, || self.now())
    }

    /// The requests a key of limit `max` may have in flight beyond its holding on this host.
    fn credit(&self, max: u64) -> u64 {
        self.settings.cold_start.credit_of(max)
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn bucket_key(&self, key: K) -> BucketKey<K> {
        BucketKey::from_parts(key, self.settings.layer, None, self.settings.name)
    }

    /// Until when a holding set by a call sent at `sent_at` may admit: its time to live less
    /// a tenth for clocks that run at different rates.
    fn usable_until(&self, sent_at: u64) -> u64 {
        let ttl = micros(self.settings.slot_ttl);
        sent_at.saturating_add(ttl - ttl / 10)
    }
}

impl<K, S, C> Engine for Shared<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    fn now(&self) -> u64 {
        Shared::now(self)
    }

    fn count_admitted(&self) {
        self.counters.admitted.fetch_add(1, Ordering::Relaxed);
    }

    fn count_refused(&self, why: NoSlot) {
        let counter = match why {
            NoSlot::Full => &self.counters.refused_full,
            NoSlot::Unavailable => &self.counters.refused_unavailable,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

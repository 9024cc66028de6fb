//! Per-core reserves: a few of a hot key's leased tokens lent to each core that serves it, so
//! that cores taking from one key do not pass its lock's cache line between them on every
//! request.
//!
//! Ground rules, which keep every decision what it would be without them:
//! - a reserve holds tokens its key's lease lent it ([`LocalBucket::lend`]): still this host's,
//!   spent only by a request on the first limit of a key whose quota has one limit;
//! - lending, and taking a reserve back ([`Reserves::recall`]), happen under the key's shard
//!   lock, which is always taken before a reserve's (never the other way round);
//! - every access to a bucket other than a request's take recalls its reserves first, so the
//!   lease's state machine sees all its tokens whenever it decides anything: a fetch, a sweep,
//!   a hand-back, an eviction, a limit's change, and a request the lease cannot serve (a
//!   refusal is never made while another core holds the key's tokens).

use std::borrow::Borrow;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use hashbrown::HashTable;

use crate::lease::LocalBucket;
use crate::quota::LeaseKey;
use crate::sync::{CacheLine, ShardLock};

/// When a key's leased tokens are lent to the cores that serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CoreReserves {
    /// Never: every request takes its key's shard lock.
    Off,
    /// When a request finds its key's shard lock held by another thread (the key, or a key
    /// beside it, is hot on several cores): the default. A host whose keys are each served by
    /// one core at a time never lends.
    #[default]
    WhenContended,
    /// Whenever a request on a key with tokens to spare finds no reserve on its core: for a
    /// host whose few keys are all hot on every core.
    Always,
}

/// The most tokens lent to one core at a time: enough that a core takes the key's lock once
/// per this many requests, few enough that a quiet core strands little until it is recalled.
const MOST_LENT: u64 = 64;

/// The most keys one core holds reserves of: a few hundred hot keys at most, so that the
/// reserves stay small (about 15 KB a core with `u64` or short keys) however many keys meet
/// on a contended lock. Reserves go back at every sweep, so the keys a core serves most have
/// theirs again soon after.
const MOST_KEYS_PER_CORE: usize = 256;

/// The reserves of a store, one stripe per core (twice as many, so that threads numbered in
/// turn rarely share one).
#[derive(Debug)]
pub(super) struct Reserves<K> {
    stripes: Box<[CacheLine<Stripe<K>>]>,
    policy: CoreReserves,
}

/// One core's reserves.
#[derive(Debug)]
struct Stripe<K> {
    /// A bit per 64th of the hash space, set for each key with a reserve here: read without
    /// the lock, so that a key without one costs a request one load of its own core's line.
    keys: AtomicU64,
    table: ShardLock<Table<K>>,
}

#[derive(Debug)]
struct Table<K> {
    reserves: HashTable<Reserve<K>>,
    /// Requests admitted from this stripe's reserves so far (all of them, recalled or not).
    served: u64,
}

/// A key's tokens lent to one core.
#[derive(Debug)]
struct Reserve<K> {
    id: LeaseKey<K>,
    group: u64,
    tokens: u64,
    /// Requests served from it since it was lent.
    served: u64,
}

/// What a request found in its core's reserves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Taken {
    /// Admitted from its key's reserve.
    Served,
    /// Its key has a reserve here, too small: the lease lends again if it can.
    Short,
    /// No reserve of its key here.
    None,
}

impl<K> Reserves<K> {
    pub(super) fn new(policy: CoreReserves) -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let stripes = match policy {
            CoreReserves::Off => 0,
            _ => (cores * 2).next_power_of_two(),
        };
        Self {
            stripes: (0..stripes)
                .map(|_| {
                    CacheLine(Stripe {
                        keys: AtomicU64::new(0),
                        table: ShardLock::new(Table {
                            reserves: HashTable::new(),
                            served: 0,
                        }),
                    })
                })
                .collect(),
            policy,
        }
    }

    pub(super) fn policy(&self) -> CoreReserves {
        self.policy
    }

    /// This thread's stripe, if reserves are on.
    #[inline(always)]
    fn own_stripe(&self) -> Option<&Stripe<K>> {
        let count = self.stripes.len();
        if count == 0 {
            return None;
        }
        self.stripes
            .get(thread_number() & (count - 1))
            .map(|s| &s.0)
    }

    /// Takes `cost` from the reserve this thread's core holds of `key` at `level` (hashed to
    /// `group`), if it holds one.
    #[inline(always)]
    pub(super) fn take<Q>(&self, group: u64, key: &Q, level: u8, cost: u64) -> Taken
    where
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        let Some(stripe) = self.own_stripe() else {
            return Taken::None;
        };
        if stripe.keys.load(Ordering::Relaxed) & bit(group) == 0 {
            return Taken::None;
        }
        let mut table = stripe.table.lock();
        let Table { reserves, served } = &mut *table;
        match reserves.find_mut(group, |r| is_reserve_of(&r.id, key, level)) {
            None => Taken::None,
            Some(reserve) if reserve.tokens >= cost => {
                reserve.tokens -= cost;
                reserve.served += 1;
                *served += 1;
                Taken::Served
            }
            Some(_) => Taken::Short,
        }
    }

    /// Whether a request that found its key's lock `contended` (and its core's reserve
    /// `short`, if any) lends this core some of the lease's tokens.
    #[inline(always)]
    pub(super) fn lends(&self, contended: bool, short: bool) -> bool {
        match self.policy {
            CoreReserves::Off => false,
            CoreReserves::WhenContended => contended || short,
            CoreReserves::Always => true,
        }
    }

    /// Lends this thread's core some of `bucket`'s tokens for `id` (hashed to `group`). Under
    /// the shard lock of `id`.
    #[cold]
    #[inline(never)]
    pub(super) fn lend(&self, group: u64, id: &LeaseKey<K>, bucket: &mut LocalBucket)
    where
        K: Clone + Eq,
    {
        let Some(stripe) = self.own_stripe() else {
            return;
        };
        let chunk = (bucket.lendable() / (2 * self.stripes.len() as u64)).min(MOST_LENT);
        // A reserve of a token or two would cost more locks than it saves.
        if chunk < 2 {
            return;
        }
        let mut table = stripe.table.lock();
        if let Some(reserve) = table.reserves.find_mut(group, |r| r.id == *id) {
            reserve.tokens += bucket.lend(chunk);
            return;
        }
        if table.reserves.len() >= MOST_KEYS_PER_CORE {
            return;
        }
        let reserve = Reserve {
            id: id.clone(),
            group,
            tokens: bucket.lend(chunk),
            served: 0,
        };
        table.reserves.insert_unique(group, reserve, |r| r.group);
        // Written under the stripe's lock, read by recalls under the key's shard lock, which
        // this thread holds until after this store.
        let keys = stripe.keys.load(Ordering::Relaxed) | bit(group);
        stripe.keys.store(keys, Ordering::Relaxed);
    }

    /// Whether any core may hold a reserve of a key hashed to `group`.
    #[inline(always)]
    pub(super) fn may_hold(&self, group: u64) -> bool {
        self.stripes
            .iter()
            .any(|s| s.0.keys.load(Ordering::Relaxed) & bit(group) != 0)
    }

    /// Whether any core holds any reserve.
    pub(super) fn any(&self) -> bool {
        self.stripes
            .iter()
            .any(|s| s.0.keys.load(Ordering::Relaxed) != 0)
    }

    /// Takes back every core's reserve of `id` (hashed to `group`) into `bucket`. Under the
    /// shard lock of `id`.
    pub(super) fn recall(&self, group: u64, id: &LeaseKey<K>, bucket: &mut LocalBucket)
    where
        K: Eq,
    {
        let bit = bit(group);
        for stripe in self.stripes.iter().map(|s| &s.0) {
            if stripe.keys.load(Ordering::Relaxed) & bit == 0 {
                continue;
            }
            let mut table = stripe.table.lock();
            let Ok(found) = table.reserves.find_entry(group, |r| r.id == *id) else {
                continue;
            };
            let (reserve, _) = found.remove();
            bucket.repay(reserve.tokens, reserve.served);
            stripe.keys.store(table.mask(), Ordering::Relaxed);
        }
    }

    /// Keys with a reserve, over all cores.
    #[cfg(test)]
    pub(super) fn keys(&self) -> usize {
        self.stripes
            .iter()
            .map(|s| s.0.table.lock().reserves.len())
            .sum()
    }

    /// Takes back every reserve of a key whose group `here` accepts (under the shard lock of
    /// all of them), giving each to `repay`: its key's group, its key, its unspent tokens and
    /// the requests it served.
    pub(super) fn recall_where(
        &self,
        here: impl Fn(u64) -> bool,
        mut repay: impl FnMut(u64, &LeaseKey<K>, u64, u64),
    ) {
        for stripe in self.stripes.iter().map(|s| &s.0) {
            if stripe.keys.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut table = stripe.table.lock();
            let before = table.reserves.len();
            table.reserves.retain(|r| {
                let recalled = here(r.group);
                if recalled {
                    repay(r.group, &r.id, r.tokens, r.served);
                }
                !recalled
            });
            if table.reserves.len() < before {
                stripe.keys.store(table.mask(), Ordering::Relaxed);
            }
        }
    }

    /// Requests admitted from reserves so far.
    pub(super) fn served(&self) -> u64 {
        self.stripes
            .iter()
            .fold(0u64, |sum, s| sum.saturating_add(s.0.table.lock().served))
    }
}

impl<K> Table<K> {
    /// The stripe's key mask: a bit set only for the keys held here.
    fn mask(&self) -> u64 {
        self.reserves.iter().fold(0, |keys, r| keys | bit(r.group))
    }
}

/// `group`'s bit in a stripe's key mask.
#[inline(always)]
fn bit(group: u64) -> u64 {
    1 << (group >> 58)
}

#[inline(always)]
fn is_reserve_of<K: Borrow<Q>, Q: Eq + ?Sized>(id: &LeaseKey<K>, key: &Q, level: u8) -> bool {
    id.slot == 0 && id.level == level && id.key.borrow() == key
}

/// This thread's number, given in turn at its first request: threads numbered one after the
/// other fall on different stripes.
#[inline(always)]
fn thread_number() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static NUMBER: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    NUMBER.with(|number| match number.get() {
        usize::MAX => {
            let next = NEXT.fetch_add(1, Ordering::Relaxed) & (usize::MAX >> 1);
            number.set(next);
            next
        }
        known => known,
    })
}

#[cfg(test)]
mod tests {
    use super::CoreReserves;
    use crate::local::LocalStore;
    use crate::local::memory::MemoryLocalStore;
    use crate::quota::LeaseKey;

    const KEY: LeaseKey<u64> = LeaseKey {
        key: 1,
        level: 0,
        slot: 0,
    };

    /// A store whose key 1 (one limit) holds `tokens`.
    fn holding(tokens: u64, policy: CoreReserves, max_keys: usize) -> MemoryLocalStore<u64> {
        let store = MemoryLocalStore::with_max_keys(max_keys)
            .unwrap()
            .with_core_reserves(policy);
        store.with_bucket(&KEY, |b| {
            b.give_back(tokens, u64::MAX);
            b.set_slots(1);
        });
        store
    }

    /// Requests of one token on key 1 admitted on a thread of their own, `most` at most.
    fn take_on_another_thread(store: &MemoryLocalStore<u64>, most: usize) -> usize {
        std::thread::scope(|s| {
            s.spawn(|| {
                (0..most)
                    .take_while(|_| store.take_group(&KEY, 1).is_plain_admission())
                    .count()
            })
            .join()
            .unwrap()
        })
    }

    /// A store whose key 1 holds 100 tokens, `takes` of them spent on another thread, whose
    /// core now holds a reserve of the key.
    fn lent_to_another_thread(takes: usize, max_keys: usize) -> MemoryLocalStore<u64> {
        let store = holding(100, CoreReserves::Always, max_keys);
        assert_eq!(take_on_another_thread(&store, takes), takes);
        assert_eq!(
            store.keys_in_reserve(),
            1,
            "the other thread's core holds one"
        );
        store
    }

    #[test]
    fn a_request_the_lease_cannot_serve_takes_every_core_s_reserve_back_first() {
        let store = lent_to_another_thread(1, 10_000);
        // This thread is admitted for every token left, the other core's reserve included,
        // and refused only once there is none anywhere.
        let here = (0..1_000)
            .take_while(|_| store.take_group(&KEY, 1).is_plain_admission())
            .count();
        assert_eq!(here, 99);
        assert_eq!(store.keys_in_reserve(), 0);
        assert_eq!(store.with_bucket(&KEY, |b| b.leased_tokens()), 0);
        assert_eq!(store.admitted_whole(), 100);
    }

    #[test]
    fn a_pass_over_the_buckets_sees_the_reserves_back_in_their_leases() {
        let store = lent_to_another_thread(5, 10_000);
        assert_eq!(
            store.admitted_whole(),
            5,
            "those served from a reserve are counted"
        );
        let mut seen = Vec::new();
        store.for_each_bucket(|_, b| seen.push((b.leased_tokens(), b.take_uncounted())));
        assert_eq!(seen, [(95, 5)]);
        assert_eq!(store.keys_in_reserve(), 0);
    }

    #[test]
    fn an_evicted_bucket_takes_its_reserves_with_it() {
        let store = lent_to_another_thread(3, 64);
        // New keys until key 1 is evicted (which ones go first depends on the layout).
        let mut kept = None;
        for key in 2..100_000 {
            store.with_bucket(&LeaseKey::new(key, 0, 0), |b| b.mark_used());
            let evicted = store.take_evicted();
            if let Some((_, bucket)) = evicted.iter().find(|(id, _)| *id == KEY) {
                kept = Some(bucket.leased_tokens());
                break;
            }
        }
        assert_eq!(
            kept,
            Some(97),
            "its lease, with the other core's reserve back"
        );
        assert_eq!(store.keys_in_reserve(), 0);
    }

    #[test]
    fn cores_racing_on_one_key_spend_its_tokens_exactly() {
        for policy in [CoreReserves::Always, CoreReserves::WhenContended] {
            let store = &holding(20_000, policy, 10_000);
            // One thread stops early, likely holding a reserve the others must take back.
            let admitted: usize = std::thread::scope(|s| {
                let threads: Vec<_> = [100, usize::MAX, usize::MAX, usize::MAX]
                    .into_iter()
                    .map(|most| {
                        s.spawn(move || {
                            std::iter::from_fn(|| {
                                store.take_group(&KEY, 1).is_plain_admission().then_some(())
                            })
                            .take(most)
                            .count()
                        })
                    })
                    .collect();
                threads.into_iter().map(|t| t.join().unwrap()).sum()
            });
            assert_eq!(admitted, 20_000, "{policy:?}");
            assert_eq!(store.admitted_whole(), 20_000, "{policy:?}");
            assert_eq!(store.with_bucket(&KEY, |b| b.leased_tokens()), 0);
        }
    }

    #[test]
    fn a_core_holds_reserves_of_a_few_hundred_keys_at_most() {
        let store = MemoryLocalStore::<u64>::with_max_keys(10_000)
            .unwrap()
            .with_core_reserves(CoreReserves::Always);
        let keys = super::MOST_KEYS_PER_CORE as u64 + 100;
        for key in 0..keys {
            let id = LeaseKey::new(key, 0, 0);
            store.with_bucket(&id, |b| {
                b.give_back(100, u64::MAX);
                b.set_slots(1);
            });
            assert!(store.take_group(&id, 1).is_plain_admission());
        }
        assert_eq!(store.keys_in_reserve(), super::MOST_KEYS_PER_CORE);
        // The keys past the bound were served from their leases, and lent nothing.
        let mut leased = Vec::new();
        store.for_each_bucket(|_, b| leased.push(b.leased_tokens()));
        assert!(leased.iter().all(|&tokens| tokens == 99));
        assert_eq!(store.keys_in_reserve(), 0);
        assert_eq!(store.admitted_whole(), keys);
    }

    #[test]
    fn a_key_is_lent_to_a_core_on_contention_or_when_its_reserve_there_ran_short() {
        let lends = |policy| {
            let reserves = super::Reserves::<u64>::new(policy);
            [(false, false), (true, false), (false, true)].map(|(c, s)| reserves.lends(c, s))
        };
        assert_eq!(lends(CoreReserves::Off), [false; 3]);
        assert_eq!(lends(CoreReserves::WhenContended), [false, true, true]);
        assert_eq!(lends(CoreReserves::Always), [true; 3]);
        let store = holding(100, CoreReserves::Off, 10_000);
        assert_eq!(take_on_another_thread(&store, 1), 1);
        assert_eq!(
            store.keys_in_reserve(),
            0,
            "a store without reserves lends nothing"
        );
    }
}

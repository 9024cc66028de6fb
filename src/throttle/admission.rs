//! All or nothing: a request drawing on several buckets (several limits, several levels) is
//! admitted only when every one of them has its cost. When one refuses, the tokens taken from
//! the others stay in their leases, so nothing is lost, and the refusal names the limit with
//! the longest wait.

use std::any::Any;
use std::sync::Arc;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use crate::clock::Clock;
use crate::local::Hit;
use crate::local::memory::{GroupHit, MemoryLocalStore};
use crate::quota::LeaseKey;
use crate::rejection::{Rejection, RejectionReason};
use crate::throttle::key::ReadBorrowed;
use crate::throttle::{Admitted, Check, Decision, Global, Key, Local, Throttle};

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Throttle<K, G, L, C> {
    /// Decides a request of `cost` on every limit of `key` at the first level. The common case
    /// (one limit, tokens leased) is one bucket lookup and a subtraction; everything else is
    /// out of line.
    #[inline(always)]
    pub(crate) fn check_key(self: &Arc<Self>, key: K, cost: u64) -> Check<K> {
        self.check_first_bucket(&LeaseKey::new(key, 0, 0), cost)
    }

    /// [`check_key`](Self::check_key) for a key's first bucket `id`, which the caller keeps.
    #[inline(always)]
    pub(crate) fn check_first_bucket(self: &Arc<Self>, id: &LeaseKey<K>, cost: u64) -> Check<K> {
        // The default store takes from all of a key's limits under one lock; the branch is
        // decided when the throttle's types are known.
        match self.memory_store() {
            Some(memory) => self.after_group_hit(id, memory.take_group(id, cost), cost),
            None => {
                let (hit, slots) = self.take_leased(id, cost);
                self.counted(self.after_first_hit(id, hit, slots, cost))
            }
        }
    }

    /// [`check_key`](Self::check_key) for the key `reader` borrows from `request`, made only
    /// when the leased tokens do not settle the request alone; `None` when the request has no
    /// key.
    #[inline(always)]
    pub(crate) fn check_borrowed<Req>(
        self: &Arc<Self>,
        reader: &dyn ReadBorrowed<Req, K>,
        request: &Req,
        cost: u64,
    ) -> Option<Check<K>> {
        let Some(memory) = self.memory_store() else {
            return Some(self.check_key(reader.owned(request)?, cost));
        };
        let hit = reader.take(request, memory, cost)?;
        if hit.is_plain_admission() {
            return Some(Check::Admit);
        }
        // Read again only now: the closure borrows from the request, so it finds the same key.
        let key = reader.owned(request)?;
        Some(self.after_group_hit(&LeaseKey::new(key, 0, 0), hit, cost))
    }

    /// Decides a use of the key whose borrowed form is `key` at the first level, making the
    /// key (`make`) only when the leases cannot decide alone.
    pub(crate) fn check_by<Q>(
        self: &Arc<Self>,
        key: &Q,
        make: impl FnOnce() -> K,
        cost: u64,
    ) -> Check<K>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let Some(memory) = self.memory_store() else {
            return self.check_key(make(), cost);
        };
        let hit = memory.take_group_by(key, 0, cost);
        if hit.is_plain_admission() {
            return Check::Admit;
        }
        self.after_group_hit(&LeaseKey::new(make(), 0, 0), hit, cost)
    }

    /// The default local store, when it is this throttle's.
    #[inline(always)]
    pub(super) fn memory_store(&self) -> Option<&MemoryLocalStore<K>> {
        (&self.local as &dyn Any).downcast_ref::<MemoryLocalStore<K>>()
    }

    /// The decision after the default store's [`take_group`](MemoryLocalStore::take_group)
    /// answered `hit` for `id`'s key, which it counted when admitted whole.
    #[inline(always)]
    pub(super) fn after_group_hit(
        self: &Arc<Self>,
        id: &LeaseKey<K>,
        hit: GroupHit,
        cost: u64,
    ) -> Check<K> {
        match hit {
            GroupHit::All { fetch: 0 } => Check::Admit,
            GroupHit::All { fetch } => {
                self.start_fetches(id, fetch);
                Check::Admit
            }
            GroupHit::First(hit @ (Hit::Admitted | Hit::AdmittedStartFetch), 1) => {
                self.after_first_hit(id, hit, 1, cost)
            }
            GroupHit::First(hit, slots) => self.counted(self.after_first_hit(id, hit, slots, cost)),
        }
    }

    /// `check`, a whole request's, counted when it admits at once (the default store counts
    /// those it admits whole on its hot path itself; a decision that comes later is counted
    /// when it does).
    #[inline(always)]
    pub(crate) fn counted(&self, check: Check<K>) -> Check<K> {
        if let Check::Admit = check {
            self.stats.requests_admitted.incr();
        }
        check
    }

    /// The decision after the first bucket of `id`'s key answered `hit`, its key having `slots`
    /// limits (0 when unknown).
    #[inline(always)]
    fn after_first_hit(
        self: &Arc<Self>,
        id: &LeaseKey<K>,
        hit: Hit,
        slots: u8,
        cost: u64,
    ) -> Check<K> {
        if hit == Hit::Admitted && slots == 1 {
            return Check::Admit;
        }
        self.check_key_further(id, hit, slots, cost)
    }

    /// Starts a fetch ahead for each slot of `id`'s key set in `slots` (a bit per slot).
    #[cold]
    #[inline(never)]
    fn start_fetches(self: &Arc<Self>, id: &LeaseKey<K>, slots: u16) {
        for slot in (0..16u8).filter(|s| slots & (1 << s) != 0) {
            self.start_fetch(LeaseKey::new(id.key.clone(), id.level, slot));
        }
    }

    /// Decides a request of `cost` on every limit of each of `keys` (first buckets of their
    /// levels).
    pub(crate) fn check_keys(self: &Arc<Self>, keys: &[LeaseKey<K>], cost: u64) -> Check<K> {
        let mut all = AllOf::new(self.clone(), cost);
        for id in keys {
            all.check_level(id.key.clone(), id.level);
        }
        self.counted(all.finish())
    }

    #[inline(never)]
    fn check_key_further(
        self: &Arc<Self>,
        id: &LeaseKey<K>,
        hit: Hit,
        slots: u8,
        cost: u64,
    ) -> Check<K> {
        let (first, slots) = self.after_take(id, hit, slots, cost);
        if slots <= 1 {
            return first;
        }
        // Only a key with several limits needs its own copy, to visit each.
        self.check_other_limits(id.clone(), first, slots, cost)
    }

    /// The limits after the first of a key: while every bucket admits at once, nothing is
    /// allocated.
    #[inline(never)]
    fn check_other_limits(
        self: &Arc<Self>,
        mut id: LeaseKey<K>,
        first: Check<K>,
        slots: u8,
        cost: u64,
    ) -> Check<K> {
        if let Check::Admit = first {
            let mut slot = 1;
            let check = loop {
                if slot >= slots {
                    return Check::Admit;
                }
                id.slot = slot;
                match self.check(&id, cost).0 {
                    Check::Admit => slot += 1,
                    other => break other,
                }
            };
            // Only now is anything kept: while every bucket admits, nothing is allocated or
            // shared.
            let mut all = AllOf::new(self.clone(), cost);
            for taken in 0..slot {
                all.taken_at_once(LeaseKey::new(id.key.clone(), id.level, taken));
            }
            all.add(id.clone(), check);
            all.check_slots(&mut id, slot + 1..slots);
            return all.finish();
        }
        let mut all = AllOf::new(self.clone(), cost);
        all.add(id.clone(), first);
        all.check_slots(&mut id, 1..slots);
        all.finish()
    }
}

/// The decisions of one request's buckets so far.
pub(crate) struct AllOf<K: Key, G: Global<K>, L: Local<K>, C: Clock> {
    throttle: Arc<Throttle<K, G, L, C>>,
    cost: u64,
    /// Buckets whose tokens were taken at once.
    taken: Vec<LeaseKey<K>>,
    /// Buckets waiting for a batch.
    waits: Vec<(LeaseKey<K>, Decision<K>)>,
    /// The refusal with the longest wait so far.
    refusal: Option<Rejection<K>>,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> AllOf<K, G, L, C> {
    pub(crate) fn new(throttle: Arc<Throttle<K, G, L, C>>, cost: u64) -> Self {
        Self {
            throttle,
            cost,
            taken: Vec::new(),
            waits: Vec::new(),
            refusal: None,
        }
    }

    fn taken_at_once(&mut self, id: LeaseKey<K>) {
        self.taken.push(id);
    }

    fn add(&mut self, id: LeaseKey<K>, check: Check<K>) {
        match check {
            Check::Admit => self.taken.push(id),
            Check::Reject(rejection) => self.refuse(*rejection),
            Check::Wait(decision) => self.waits.push((id, decision)),
        }
    }

    fn refuse(&mut self, rejection: Rejection<K>) {
        self.refusal = Some(match self.refusal.take() {
            Some(known) if outlasts(&known, &rejection) => known,
            _ => rejection,
        });
    }

    /// Decides `key`'s buckets at level `level`.
    pub(crate) fn check_level(&mut self, key: K, level: u8) {
        let mut id = LeaseKey::new(key, level, 0);
        let slots = if self.refusal.is_none() {
            let (check, slots) = self.throttle.check(&id, self.cost);
            self.add(id.clone(), check);
            slots
        } else {
            self.probe(&id)
        };
        self.check_slots(&mut id, 1..slots);
    }

    /// Decides the buckets of `id`'s key and level in `slots`; once one has refused, the
    /// others are only looked at (nothing taken, nothing fetched) for a longer wait.
    fn check_slots(&mut self, id: &mut LeaseKey<K>, slots: std::ops::Range<u8>) {
        for slot in slots {
            id.slot = slot;
            if self.refusal.is_some() {
                self.probe(id);
            } else {
                let check = self.throttle.check(id, self.cost).0;
                self.add(id.clone(), check);
            }
        }
    }

    /// Looks at bucket `id` without taking anything; returns how many limits its key has.
    fn probe(&mut self, id: &LeaseKey<K>) -> u8 {
        let (refusal, slots) = self.throttle.known_refusal(id, self.cost);
        if let Some(rejection) = refusal {
            self.refuse(rejection);
        }
        slots
    }

    /// The request's decision: refused if any bucket refused (the tokens others took go back
    /// to their leases; waits are dropped, which gives back theirs), admitted if all admitted at
    /// once, or else a wait for the batches.
    pub(crate) fn finish(mut self) -> Check<K> {
        if let Some(refusal) = self.refusal.take() {
            for id in &self.taken {
                self.throttle.undo(id, self.cost);
            }
            return Check::reject(refusal);
        }
        if self.waits.is_empty() {
            return Check::Admit;
        }
        let held = Held::new(self.throttle, self.cost, self.taken);
        Check::Wait(Box::pin(wait(held, self.waits)))
    }
}

/// Waits for every bucket's batch at once, so that a refusal is known as soon as any bucket's
/// is (a verdict read late would be stale: its tokens may be there by then).
async fn wait<K: Key, G: Global<K>, L: Local<K>, C: Clock>(
    mut held: Held<K, G, L, C>,
    waits: Vec<(LeaseKey<K>, Decision<K>)>,
) -> Result<Admitted, Rejection<K>> {
    let mut waits: FuturesUnordered<_> = waits
        .into_iter()
        .map(|(id, decision)| async move { (id, decision.await) })
        .collect();
    let mut admitted = Admitted::LEASED;
    while let Some((id, decided)) = waits.next().await {
        let decided = decided?;
        admitted = admitted.and(decided);
        // A bucket the failure policy decided took nothing from its lease.
        if decided.from_leases() {
            held.hold_after_wait(id);
        }
    }
    held.kept = true;
    Ok(admitted)
}

/// Whether `a` should be reported over `b`: a request that can never be served says so, and
/// otherwise the longer wait wins.
fn outlasts<K>(a: &Rejection<K>, b: &Rejection<K>) -> bool {
    let never = |r: &Rejection<K>| matches!(r.reason, RejectionReason::CostExceedsCapacity { .. });
    match (never(a), never(b)) {
        (true, _) => true,
        (false, true) => false,
        (false, false) => a.retry_after >= b.retry_after,
    }
}

/// Tokens a waiting request holds in some buckets while it waits for others: given back unless
/// the request is admitted (refused, or dropped while waiting). Their leases count them as held
/// meanwhile ([`LocalBucket::hold_while_waiting`](crate::lease::LocalBucket::hold_while_waiting)).
struct Held<K: Key, G: Global<K>, L: Local<K>, C: Clock> {
    throttle: Arc<Throttle<K, G, L, C>>,
    cost: u64,
    at_once: Vec<LeaseKey<K>>,
    /// Buckets that took the tokens from their leases after a batch.
    after_wait: Vec<LeaseKey<K>>,
    kept: bool,
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Held<K, G, L, C> {
    /// Holds the tokens taken at once from the buckets `at_once`.
    fn new(throttle: Arc<Throttle<K, G, L, C>>, cost: u64, at_once: Vec<LeaseKey<K>>) -> Self {
        for id in &at_once {
            throttle
                .local
                .with_bucket(id, |b| b.hold_while_waiting(cost));
        }
        Self {
            throttle,
            cost,
            at_once,
            after_wait: Vec::new(),
            kept: false,
        }
    }

    /// Holds the tokens bucket `id` took from its lease after its batch came.
    fn hold_after_wait(&mut self, id: LeaseKey<K>) {
        self.throttle
            .local
            .with_bucket(&id, |b| b.hold_while_waiting(self.cost));
        self.after_wait.push(id);
    }
}

impl<K: Key, G: Global<K>, L: Local<K>, C: Clock> Drop for Held<K, G, L, C> {
    fn drop(&mut self) {
        for id in self.at_once.iter().chain(&self.after_wait) {
            self.throttle
                .local
                .with_bucket(id, |b| b.stop_holding(self.cost));
        }
        if self.kept {
            return;
        }
        for id in &self.at_once {
            self.throttle.take_back(id, self.cost, None, true);
        }
        for id in &self.after_wait {
            self.throttle.take_back(id, self.cost, None, false);
        }
    }
}

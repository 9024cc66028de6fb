//! Leased tokens on their way back to the global store, by bucket: those kept for the next
//! sweep, and those whose call is out.
//!
//! A fetch must not overtake them. Sent after a hand-back but reaching the store first (a
//! store that does not apply one host's calls in order, a batch of its own sent ahead, or a
//! hand-back still queued behind a key flood's), it would take the global bucket refilled
//! around those tokens, and they would land on top of it: spent twice. So a fetch sends its
//! bucket's kept hand-backs itself, and waits for those out to land
//! ([`Throttle::await_hand_backs`](super::Throttle::await_hand_backs)). Tokens being collected
//! from evicted buckets are neither in a bucket nor kept yet: a fetch waits for the collection
//! to end, then looks for its bucket's.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::local::LocalBucket;
use crate::quota::LeaseKey;
use crate::sync::lock;
use crate::throttle::Key;

/// Leased tokens on their way back to the global bucket that dispensed them (the limit whose
/// name's [id](crate::quota::Name::id) is `dispenser`; 0 when the lease did not know it).
pub(crate) struct Return<K> {
    pub(super) id: LeaseKey<K>,
    pub(super) dispenser: u32,
    pub(super) tokens: u64,
    /// When they left the lease: a calendar quota's tokens are not handed back into a window
    /// after theirs.
    pub(super) taken_at: u64,
    /// The key was far from its limit: no host needs these tokens soon, so the hand-back may
    /// linger for other calls to join its round trip.
    pub(super) unhurried: bool,
}

impl<K: Clone> Return<K> {
    /// `tokens` taken out of bucket `id`'s lease at `now`, to hand back (none: nothing to).
    pub(super) fn taken(
        id: &LeaseKey<K>,
        bucket: &LocalBucket,
        tokens: u64,
        now: u64,
        unhurried: bool,
    ) -> Option<Self> {
        (tokens > 0).then(|| Self {
            id: id.clone(),
            dispenser: bucket.dispenser(),
            tokens,
            taken_at: now,
            unhurried,
        })
    }
}

/// A bucket's hand-backs: kept for the next sweep, and out.
#[derive(Default, Clone, Copy)]
struct Counts {
    kept: u32,
    out: u32,
}

struct State<K> {
    /// In the order they were kept.
    kept: VecDeque<Return<K>>,
    by_id: HashMap<LeaseKey<K>, Counts>,
    out: usize,
    /// Collections under way ([`HandBacks::collect`]).
    collecting: usize,
}

/// The throttle's hand-backs not yet landed. Shared by the sweeper and the fetches.
pub(crate) struct HandBacks<K> {
    state: Mutex<State<K>>,
    /// Hand-backs kept or out, over all buckets, and collections under way: read without the
    /// lock, so that a fetch looks for its bucket's only when there are some.
    count: AtomicUsize,
    /// Told whenever a hand-back has landed (or never will), and when a collection ends.
    landed: tokio::sync::Notify,
}

impl<K> Default for HandBacks<K> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                kept: VecDeque::new(),
                by_id: HashMap::new(),
                out: 0,
                collecting: 0,
            }),
            count: AtomicUsize::new(0),
            landed: tokio::sync::Notify::new(),
        }
    }
}

impl<K: Key> HandBacks<K> {
    /// Whether any hand-back is kept or out.
    pub(super) fn any(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// Hand-backs kept for the next sweep.
    pub(super) fn kept(&self) -> usize {
        lock(&self.state).kept.len()
    }

    /// Keeps `backs` for the next sweep (or their bucket's next fetch) to send.
    pub(super) fn keep(&self, backs: impl IntoIterator<Item = Return<K>>) {
        let mut state = lock(&self.state);
        for back in backs {
            state.by_id.entry(back.id.clone()).or_default().kept += 1;
            state.kept.push_back(back);
        }
        self.recount(&state);
    }

    /// Keeps the hand-backs `take` takes out of buckets no longer in the local store (run
    /// without the registry's lock: a local store's own lock must never be taken inside it).
    /// Until they are kept, every fetch waits ([`collected`](Self::collected)): its bucket's
    /// tokens may be among them.
    pub(super) fn collect(&self, take: impl FnOnce() -> Vec<Return<K>>) {
        // Ends once what it took is kept, so a fetch that sees it ended sees them.
        let _collecting = Collecting::begin(self);
        self.keep(take());
    }

    /// Waits until no collection is under way.
    pub(super) async fn collected(&self) {
        self.until(|state| state.collecting == 0, || {}).await;
    }

    /// `back`, out from now on: its bucket's fetches wait until the returned guard is dropped.
    pub(super) fn send(&self, back: Return<K>) -> Outgoing<'_, K> {
        let mut state = lock(&self.state);
        state.by_id.entry(back.id.clone()).or_default().out += 1;
        state.out += 1;
        self.recount(&state);
        self.outgoing(back)
    }

    /// The hand-back kept longest, out from now on.
    pub(super) fn send_next_kept(&self) -> Option<Outgoing<'_, K>> {
        let mut state = lock(&self.state);
        let back = state.kept.pop_front()?;
        let counts = state.by_id.entry(back.id.clone()).or_default();
        counts.kept -= 1;
        counts.out += 1;
        state.out += 1;
        self.recount(&state);
        Some(self.outgoing(back))
    }

    /// Bucket `id`'s kept hand-backs, out from now on, to go at once.
    pub(super) fn send_kept_of(&self, id: &LeaseKey<K>) -> Vec<Outgoing<'_, K>> {
        let mut state = lock(&self.state);
        let Some(counts) = state.by_id.get_mut(id).filter(|c| c.kept > 0) else {
            return Vec::new();
        };
        let taken = std::mem::take(&mut counts.kept);
        counts.out += taken;
        state.out += taken as usize;
        let (mine, others) = std::mem::take(&mut state.kept)
            .into_iter()
            .partition(|back| back.id == *id);
        state.kept = others;
        self.recount(&state);
        drop(state);
        mine.into_iter()
            .map(|back| {
                self.outgoing(Return {
                    unhurried: false,
                    ..back
                })
            })
            .collect()
    }

    /// Whether a hand-back of bucket `id` is out.
    #[cfg(test)]
    fn is_out(&self, id: &LeaseKey<K>) -> bool {
        Self::out_of(&lock(&self.state), id)
    }

    fn out_of(state: &State<K>, id: &LeaseKey<K>) -> bool {
        state.by_id.get(id).is_some_and(|c| c.out > 0)
    }

    /// Waits until no hand-back of bucket `id` is out; `hurry` is run while one is.
    pub(super) async fn landed(&self, id: &LeaseKey<K>, hurry: impl Fn()) {
        self.until(|state| !Self::out_of(state, id), hurry).await;
    }

    /// Waits until `done` holds; `hurry` is run each time it does not.
    async fn until(&self, done: impl Fn(&State<K>) -> bool, hurry: impl Fn()) {
        loop {
            let landed = self.landed.notified();
            let mut landed = std::pin::pin!(landed);
            // Registered before looking, so that a landing in between wakes it.
            landed.as_mut().enable();
            if done(&lock(&self.state)) {
                return;
            }
            hurry();
            landed.await;
        }
    }

    /// The guard of `back`, counted as out.
    fn outgoing(&self, back: Return<K>) -> Outgoing<'_, K> {
        Outgoing {
            hand_backs: self,
            id: back.id.clone(),
            back: Some(back),
        }
    }

    fn landed_one(&self, id: &LeaseKey<K>) {
        let mut state = lock(&self.state);
        state.out -= 1;
        if let Some(counts) = state.by_id.get_mut(id) {
            counts.out -= 1;
            if counts.out == 0 && counts.kept == 0 {
                state.by_id.remove(id);
            }
        }
        self.recount(&state);
        drop(state);
        self.landed.notify_waiters();
    }

    fn recount(&self, state: &State<K>) {
        let count = state.kept.len() + state.out + state.collecting;
        self.count.store(count, Ordering::Release);
    }
}

/// A collection under way: counted from [`begin`](Self::begin) until dropped, however its
/// `take` ends (a panic included), so no fetch waits for it forever.
struct Collecting<'a, K: Key> {
    hand_backs: &'a HandBacks<K>,
}

impl<'a, K: Key> Collecting<'a, K> {
    fn begin(hand_backs: &'a HandBacks<K>) -> Self {
        let mut state = lock(&hand_backs.state);
        state.collecting += 1;
        hand_backs.recount(&state);
        Self { hand_backs }
    }
}

impl<K: Key> Drop for Collecting<'_, K> {
    fn drop(&mut self) {
        let mut state = lock(&self.hand_backs.state);
        state.collecting -= 1;
        self.hand_backs.recount(&state);
        drop(state);
        self.hand_backs.landed.notify_waiters();
    }
}

/// A hand-back on its way: its bucket's fetches wait until this is dropped (answered, failed,
/// timed out, kept again, or its future dropped). Dropped before its tokens were
/// [taken](Self::take), it keeps them for the next sweep.
pub(crate) struct Outgoing<'a, K: Key> {
    hand_backs: &'a HandBacks<K>,
    id: LeaseKey<K>,
    back: Option<Return<K>>,
}

impl<K: Key> Outgoing<'_, K> {
    /// The tokens, from now on in the caller's charge.
    pub(super) fn take(&mut self) -> Option<Return<K>> {
        self.back.take()
    }
}

impl<K: Key> Drop for Outgoing<'_, K> {
    fn drop(&mut self) {
        if let Some(back) = self.back.take() {
            self.hand_backs.keep([back]);
        }
        self.hand_backs.landed_one(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    fn back(key: &str, tokens: u64) -> Return<String> {
        Return {
            id: LeaseKey::new(key.to_owned(), 0, 0),
            dispenser: 0,
            tokens,
            taken_at: 0,
            unhurried: true,
        }
    }

    #[test]
    fn a_hand_back_counts_from_kept_until_its_guard_is_dropped() {
        let hand_backs = HandBacks::default();
        let (a, b) = (back("a", 1).id, back("b", 1).id);
        assert!(!hand_backs.any());
        hand_backs.keep([back("a", 1), back("b", 2), back("a", 3)]);
        assert!(hand_backs.any() && !hand_backs.is_out(&a));
        // A fetch of "a" takes both of its own, hurried, in their order; "b"'s stays kept.
        let mut mine = hand_backs.send_kept_of(&a);
        let taken: Vec<_> = mine.iter_mut().filter_map(Outgoing::take).collect();
        let tokens: Vec<_> = taken.iter().map(|r| (r.tokens, r.unhurried)).collect();
        assert_eq!(tokens, [(1, false), (3, false)]);
        assert!(hand_backs.is_out(&a) && hand_backs.send_kept_of(&a).is_empty());
        assert_eq!(hand_backs.kept(), 1);
        drop(mine.pop());
        assert!(hand_backs.is_out(&a), "one of the two still out");
        drop(mine);
        assert!(!hand_backs.is_out(&a));
        // The sweep sends the rest; a guard dropped untaken keeps its tokens again.
        let next = hand_backs.send_next_kept();
        assert!(next.is_some() && hand_backs.is_out(&b) && hand_backs.kept() == 0);
        drop(next);
        assert!(!hand_backs.is_out(&b) && hand_backs.kept() == 1);
        let mut last = hand_backs.send_next_kept();
        assert_eq!(
            last.as_mut().and_then(Outgoing::take).map(|r| r.tokens),
            Some(2)
        );
        drop(last);
        assert!(!hand_backs.any());
        assert!(
            lock(&hand_backs.state).by_id.is_empty(),
            "nothing left behind"
        );
    }

    #[test]
    fn a_wait_for_collections_ends_once_what_they_took_is_kept() {
        let hand_backs = HandBacks::default();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut waiting = std::pin::pin!(hand_backs.collected());
        hand_backs.collect(|| {
            // Taken out of an evicted bucket, not kept yet: a fetch must not look now.
            assert!(hand_backs.any() && hand_backs.kept() == 0);
            assert!(waiting.as_mut().poll(&mut cx).is_pending());
            vec![back("a", 4)]
        });
        assert!(waiting.as_mut().poll(&mut cx).is_ready());
        assert_eq!(hand_backs.kept(), 1);
        // A take that panics (a custom store's) ends its collection all the same.
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            hand_backs.collect(|| panic!("the store's take_evicted failed"))
        }));
        assert!(panicked.is_err());
        let mut after = std::pin::pin!(hand_backs.collected());
        assert!(after.as_mut().poll(&mut cx).is_ready());
        assert_eq!(hand_backs.kept(), 1);
    }

    #[test]
    fn a_wait_for_a_landing_ends_when_its_buckets_last_hand_back_lands() {
        let hand_backs = HandBacks::default();
        let id = back("a", 1).id;
        let (first, second) = (hand_backs.send(back("a", 1)), hand_backs.send(back("a", 2)));
        let mut waiting = std::pin::pin!(hand_backs.landed(&id, || {}));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        drop(first);
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        drop(second);
        assert!(waiting.as_mut().poll(&mut cx).is_ready());
    }
}

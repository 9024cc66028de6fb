//! Leased tokens on their way back to the global store, by bucket: those kept for the next
//! sweep, and those whose call is out.
//!
//! A fetch must not overtake them. Sent after a hand-back but reaching the store first (a
//! store that does not apply one host's calls in order, a batch of its own sent ahead, or a
//! hand-back still queued behind a key flood's), it would take the global bucket refilled
//! around those tokens, and they would land on top of it: spent twice. So a fetch sends its
//! bucket's kept hand-backs itself, and waits for those out to land
//! ([`Throttle::await_hand_backs`](super::Throttle::await_hand_backs)).

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
}

/// The throttle's hand-backs not yet landed. Shared by the sweeper and the fetches.
pub(crate) struct HandBacks<K> {
    state: Mutex<State<K>>,
    /// Hand-backs kept or out, over all buckets: read without the lock, so that a fetch looks
    /// for its bucket's only when there are some.
    count: AtomicUsize,
    /// Told whenever a hand-back has landed, or never will.
    landed: tokio::sync::Notify,
}

impl<K> Default for HandBacks<K> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                kept: VecDeque::new(),
                by_id: HashMap::new(),
                out: 0,
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
    pub(super) fn is_out(&self, id: &LeaseKey<K>) -> bool {
        lock(&self.state).by_id.get(id).is_some_and(|c| c.out > 0)
    }

    /// Waits until no hand-back of bucket `id` is out; `hurry` is run while one is.
    pub(super) async fn landed(&self, id: &LeaseKey<K>, hurry: impl Fn()) {
        loop {
            let landed = self.landed.notified();
            let mut landed = std::pin::pin!(landed);
            // Registered before looking, so that a landing in between wakes it.
            landed.as_mut().enable();
            if !self.is_out(id) {
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
        self.count
            .store(state.kept.len() + state.out, Ordering::Release);
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

//! Hand-backs of leases left unused or evicted, and a burst that comes before they land.
//!
//! A lease unused for its time-to-live goes back to the global bucket, which has refilled
//! around it. Were its tokens taken out when the sweep visits it but queued for the store only
//! at the end of the pass, a burst in between would find the lease empty and fetch the whole
//! refilled bucket first, and the hand-back would then land on top of it. The same for an
//! evicted bucket's lease, handed back at the next sweep: its key coming back before that
//! gets its bucket back. And a store that does not apply a host's calls in the order they were
//! sent could let a fetch sent after a hand-back overtake it: a fetch waits for its bucket's
//! hand-backs to land, and for evicted buckets being collected on another thread to be kept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hierarchical_throttle::batch::FractionOfCapacity;
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::local::{LocalBucket, LocalStore};
use hierarchical_throttle::quota::LeaseKey;
use hierarchical_throttle::{
    ColdStart, HierarchicalThrottleLayer, Limit, MemoryGlobalStore, MemoryLocalStore,
};
use tokio::sync::Notify;

mod common;
use common::held_back::HeldBack;

/// One part of [`TwoParts`]: its buckets behind one lock.
type Part = Mutex<HashMap<LeaseKey<String>, LocalBucket>>;

/// A local store in two parts: keys named `late-…` in the second, the others in the first.
/// The throttle's pass over it lets other tasks run after each part that holds more buckets
/// than a pass visits between turns. Armed, it tells when its first part has been visited.
#[derive(Clone, Default)]
struct TwoParts {
    parts: Arc<[Part; 2]>,
    armed: Arc<AtomicBool>,
    first_part_visited: Arc<Notify>,
}

impl TwoParts {
    fn part_of(key: &LeaseKey<String>) -> usize {
        usize::from(key.key().starts_with("late-"))
    }
}

impl LocalStore<LeaseKey<String>> for TwoParts {
    fn with_bucket<R>(&self, key: &LeaseKey<String>, f: impl FnOnce(&mut LocalBucket) -> R) -> R {
        let mut part = self.parts[Self::part_of(key)].lock().unwrap();
        f(part.entry(key.clone()).or_default())
    }

    fn for_each_bucket(&self, mut f: impl FnMut(&LeaseKey<String>, &mut LocalBucket)) {
        for part in 0..2 {
            self.for_each_bucket_in(part, &mut f);
        }
    }

    fn parts(&self) -> usize {
        2
    }

    fn for_each_bucket_in(
        &self,
        part: usize,
        mut f: impl FnMut(&LeaseKey<String>, &mut LocalBucket),
    ) {
        for (key, bucket) in self.parts[part].lock().unwrap().iter_mut() {
            f(key, bucket);
        }
        if part == 0 && self.armed.swap(false, Ordering::SeqCst) {
            self.first_part_visited.notify_one();
        }
    }

    fn take_evicted(&self) -> Vec<(LeaseKey<String>, LocalBucket)> {
        Vec::new()
    }

    fn len(&self) -> usize {
        self.parts.iter().map(|p| p.lock().unwrap().len()).sum()
    }
}

/// How many of `decisions`, all made at one instant, admitted their requests.
async fn admitted<T, E>(
    decisions: impl Iterator<Item = impl Future<Output = Result<T, E>>>,
) -> u64 {
    let decided = futures_util::future::join_all(decisions).await;
    decided.iter().filter(|d| d.is_ok()).count() as u64
}

#[tokio::test(start_paused = true)]
async fn a_burst_during_a_sweep_spends_the_unused_lease_instead_of_overtaking_its_hand_back() {
    let local = TwoParts::default();
    let capacity = 100;
    let layer = HierarchicalThrottleLayer::builder()
        .key(|key: &String| Some(key.clone()))
        .clock(TokioClock::new())
        .limit(Limit::per_second(capacity).burst(capacity).unwrap())
        .cold_start(ColdStart::Exact)
        .keep_small_leases(false)
        .batch_policy(FractionOfCapacity::new(0.5).unwrap())
        .lease_ttl(Duration::from_secs(1))
        .local_store(local.clone())
        .global_store(MemoryGlobalStore::with_clock(TokioClock::new()))
        .build()
        .unwrap();
    let burst = |requests| admitted((0..requests).map(|_| layer.acquire("k".to_owned(), 1)));
    // A few requests leave "k" holding most of a batch of half its capacity; 300 other keys
    // fill each part of the store. Then nothing uses "k": the sweep one time-to-live on finds
    // its lease unused, the global bucket refilled around it.
    let warm = burst(10).await;
    let fillers = (0..300).flat_map(|i| [format!("other-{i}"), format!("late-{i}")]);
    futures_util::future::join_all(fillers.map(|key| layer.acquire(key, 1))).await;
    let key = LeaseKey::new("k".to_owned(), 0, 0);
    let held = local.with_bucket(&key, |b| b.leased_tokens());
    assert!(held > 0, "the lease holds tokens to hand back");
    tokio::time::sleep(Duration::from_millis(750)).await;
    local.armed.store(true, Ordering::SeqCst);
    // A burst comes while the sweep at 1 s is between its parts, and another 20 ms on.
    local.first_part_visited.notified().await;
    let during = burst(300).await;
    // The key is known short for its next token's 10 ms; the next burst comes 20 ms on.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let after = burst(300).await;
    // The bucket's capacity and 20 ms of its rate, whatever the lease held: before, the burst
    // during the sweep got the refilled bucket and the one after got the lease's tokens too,
    // handed back on top of it.
    assert_eq!(
        (during, after),
        (capacity, 2),
        "warmed with {warm}, the lease held {held}"
    );
}

type TestLayer<G, L = MemoryLocalStore<String>> =
    HierarchicalThrottleLayer<String, String, G, L, TokioClock>;

/// A layer on `store`, 100 a second burst 100, whose leases are batches of half the capacity
/// and go back whole once unused for a second.
fn handing_back_unused_leases<G>(store: G, limit: Limit) -> TestLayer<G>
where
    G: hierarchical_throttle::global::GlobalStore<hierarchical_throttle::quota::BucketKey<String>>,
{
    HierarchicalThrottleLayer::builder()
        .key(|key: &String| Some(key.clone()))
        .clock(TokioClock::new())
        .limit(limit)
        .cold_start(ColdStart::Exact)
        .keep_small_leases(false)
        .batch_policy(FractionOfCapacity::new(0.5).unwrap())
        .lease_ttl(Duration::from_secs(1))
        .global_store(store)
        .build()
        .unwrap()
}

/// The local store of [`with_k_evicted`]: 64 keys.
fn evicting_store() -> MemoryLocalStore<String> {
    MemoryLocalStore::with_max_keys(64)
        .unwrap()
        .with_hash_seed(1)
}

/// A layer on `store` whose local store holds 64 keys: "k" takes a batch of half its capacity
/// for 10 requests, then a flood of other keys evicts it, the 40 tokens it holds and all.
async fn with_k_evicted<G>(store: G) -> TestLayer<G>
where
    G: hierarchical_throttle::global::GlobalStore<hierarchical_throttle::quota::BucketKey<String>>,
{
    with_k_evicted_from(store, evicting_store()).await
}

/// [`with_k_evicted`], the local store `local` (which evicts as [`evicting_store`] does).
async fn with_k_evicted_from<G, L>(store: G, local: L) -> TestLayer<G, L>
where
    G: hierarchical_throttle::global::GlobalStore<hierarchical_throttle::quota::BucketKey<String>>,
    L: LocalStore<LeaseKey<String>>,
{
    let layer = evicting_layer(store, local, 0.5);
    let first = admitted((0..10).map(|_| layer.acquire("k".to_owned(), 1))).await;
    assert_eq!(first, 10);
    evict_k(&layer).await;
    layer
}

/// A layer on `store` and `local`, 100 a second burst 100, whose batches are `batch` of the
/// capacity and whose leases go back once unused for a second.
fn evicting_layer<G, L>(store: G, local: L, batch: f64) -> TestLayer<G, L>
where
    G: hierarchical_throttle::global::GlobalStore<hierarchical_throttle::quota::BucketKey<String>>,
    L: LocalStore<LeaseKey<String>>,
{
    HierarchicalThrottleLayer::builder()
        .key(|key: &String| Some(key.clone()))
        .clock(TokioClock::new())
        .limit(Limit::per_second(100).burst(100).unwrap())
        .cold_start(ColdStart::Exact)
        .batch_policy(FractionOfCapacity::new(batch).unwrap())
        .lease_ttl(Duration::from_secs(1))
        .local_store(local)
        .global_store(store)
        .build()
        .unwrap()
}

/// Floods `layer` with other keys until its local store has evicted "k".
async fn evict_k<G, L>(layer: &TestLayer<G, L>)
where
    G: hierarchical_throttle::global::GlobalStore<hierarchical_throttle::quota::BucketKey<String>>,
    L: LocalStore<LeaseKey<String>>,
{
    let evicted = || {
        let mut present = false;
        layer
            .local_store()
            .for_each_bucket(|id, _| present |= id.key() == "k");
        !present
    };
    let mut flood = 0..100_000;
    while !evicted() {
        assert!(!flood.is_empty(), "evicted within the flood");
        let keys = flood.by_ref().take(64).map(|i| format!("other-{i}"));
        futures_util::future::join_all(keys.map(|key| layer.acquire(key, 1))).await;
    }
}

#[tokio::test(start_paused = true)]
async fn an_evicted_key_that_comes_back_before_the_sweep_spends_its_own_lease() {
    let layer = with_k_evicted(MemoryGlobalStore::with_clock(TokioClock::new())).await;
    let burst = |requests| admitted((0..requests).map(|_| layer.acquire("k".to_owned(), 1)));
    // It comes back before the sweep (every half second) hands its tokens back: a burst, then
    // another 70 ms on, after that sweep.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let during = burst(300).await;
    tokio::time::sleep(Duration::from_millis(70)).await;
    let after = burst(300).await;
    // The capacity and 70 ms of the rate: before, the key's new bucket fetched the refilled
    // bucket (95), and the sweep handed the evicted bucket's 40 back on top of what was left.
    assert_eq!((during, after), (100, 7));
}

#[tokio::test(start_paused = true)]
async fn a_fetch_waits_for_its_buckets_hand_back_to_land() {
    let capacity = 100;
    // Hand-backs applied 40 ms late: a later fetch reaches the bucket first.
    let layer = handing_back_unused_leases(
        HeldBack::releases_late(Duration::from_millis(40)),
        Limit::per_second(100).burst(100).unwrap(),
    );
    let burst = |requests| admitted((0..requests).map(|_| layer.acquire("k".to_owned(), 1)));
    // "k" holds 40 of a batch of 50, then nothing uses it: the sweep at 1 s hands them back,
    // the global bucket refilled around them.
    assert_eq!(burst(10).await, 10);
    tokio::time::sleep(Duration::from_millis(1_001)).await;
    let key = LeaseKey::new("k".to_owned(), 0, 0);
    let left = layer.local_store().peek_bucket(&key, |b| b.leased_tokens());
    assert_eq!(left, Some(0), "the hand-back is on its way");
    // A burst 1 ms after the sweep, its fetch sent before the hand-back lands; another 50 ms on.
    let during = burst(300).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let after = burst(300).await;
    // The capacity and 50 ms of the rate: before, the burst's fetch took the refilled bucket
    // and the 40 landed on top of what was left, for the next burst.
    assert_eq!((during, after), (capacity, 5));
}

#[tokio::test(start_paused = true)]
async fn a_fetch_waits_for_its_evicted_buckets_hand_back_to_land() {
    let store = HeldBack::releases_late(Duration::from_millis(40));
    let layer = with_k_evicted(store).await;
    let burst = |requests| admitted((0..requests).map(|_| layer.acquire("k".to_owned(), 1)));
    // The sweep at 500 ms hands the evicted bucket's 40 back, applied 40 ms late; a burst 1 ms
    // after it, its fetch sent before they land; another 70 ms on.
    tokio::time::sleep(Duration::from_millis(501)).await;
    let during = burst(300).await;
    tokio::time::sleep(Duration::from_millis(70)).await;
    let after = burst(300).await;
    // The capacity and 70 ms of the rate: before, the burst's fetch took the bucket refilled
    // around the 40, which landed on top of what was left.
    assert_eq!((during, after), (100, 7));
}

#[tokio::test(start_paused = true)]
async fn a_fetch_sends_the_hand_back_its_key_left_for_the_next_sweep_first() {
    let layer = with_k_evicted(MemoryGlobalStore::with_clock(TokioClock::new())).await;
    let burst = |requests| admitted((0..requests).map(|_| layer.acquire("k".to_owned(), 1)));
    // Reading the counters counts what evicted buckets served, and leaves their tokens for the
    // next sweep to hand back: "k" comes back before that sweep, and again 70 ms after it.
    let stats = layer.stats();
    assert!(stats.requests_admitted >= 10);
    tokio::time::sleep(Duration::from_millis(450)).await;
    let during = burst(300).await;
    tokio::time::sleep(Duration::from_millis(70)).await;
    let after = burst(300).await;
    // The capacity and 70 ms of the rate: before, the key's new bucket fetched the refilled
    // bucket, and the sweep handed the 40 back on top of what was left.
    assert_eq!((during, after), (100, 7));
}

/// [`evicting_store`], whose next [`take_evicted`](LocalStore::take_evicted), once armed, tells
/// when it has taken the evicted buckets out and holds them until told to go on: a fetch on
/// another thread meanwhile finds them neither in the store nor kept.
#[derive(Clone)]
struct SlowCollection {
    store: Arc<MemoryLocalStore<String>>,
    armed: Arc<AtomicBool>,
    taken: std::sync::mpsc::SyncSender<()>,
    go_on: Arc<Mutex<std::sync::mpsc::Receiver<()>>>,
}

impl LocalStore<LeaseKey<String>> for SlowCollection {
    fn with_bucket<R>(&self, key: &LeaseKey<String>, f: impl FnOnce(&mut LocalBucket) -> R) -> R {
        self.store.with_bucket(key, f)
    }

    fn peek_bucket<R>(
        &self,
        key: &LeaseKey<String>,
        f: impl FnOnce(&LocalBucket) -> R,
    ) -> Option<R> {
        self.store.peek_bucket(key, f)
    }

    fn for_each_bucket(&self, f: impl FnMut(&LeaseKey<String>, &mut LocalBucket)) {
        self.store.for_each_bucket(f);
    }

    fn parts(&self) -> usize {
        self.store.parts()
    }

    fn for_each_bucket_in(&self, part: usize, f: impl FnMut(&LeaseKey<String>, &mut LocalBucket)) {
        self.store.for_each_bucket_in(part, f);
    }

    fn take_evicted(&self) -> Vec<(LeaseKey<String>, LocalBucket)> {
        let evicted = self.store.take_evicted();
        if self.armed.swap(false, Ordering::SeqCst) {
            self.taken.send(()).unwrap();
            self.go_on.lock().unwrap().recv().unwrap();
        }
        evicted
    }

    fn len(&self) -> usize {
        self.store.len()
    }
}

#[tokio::test(start_paused = true)]
async fn a_fetch_waits_for_evicted_buckets_being_collected_on_another_thread() {
    let (taken_tx, taken) = std::sync::mpsc::sync_channel(1);
    let (go_on, go_on_rx) = std::sync::mpsc::sync_channel(1);
    let local = SlowCollection {
        store: Arc::new(evicting_store()),
        armed: Arc::new(AtomicBool::new(false)),
        taken: taken_tx,
        go_on: Arc::new(Mutex::new(go_on_rx)),
    };
    let layer = with_k_evicted_from(
        MemoryGlobalStore::with_clock(TokioClock::new()),
        local.clone(),
    )
    .await;
    let burst = |requests| admitted((0..requests).map(|_| layer.acquire("k".to_owned(), 1)));
    // A counters' read on another thread takes the evicted "k" out of the store (its 40
    // tokens with it) and stops there; "k" comes back meanwhile.
    tokio::time::sleep(Duration::from_millis(450)).await;
    local.armed.store(true, Ordering::SeqCst);
    let reader = std::thread::spawn({
        let layer = layer.clone();
        move || layer.stats()
    });
    // Blocking this runtime's only thread: nothing here moves until the reader has taken them.
    taken.recv().unwrap();
    let mut burst_during = std::pin::pin!(burst(300));
    let mut during = None;
    for _ in 0..20 {
        during = futures_util::FutureExt::now_or_never(burst_during.as_mut());
        if during.is_some() {
            break;
        }
        tokio::task::yield_now().await;
    }
    go_on.send(()).unwrap();
    reader.join().unwrap();
    let during = match during {
        Some(admitted) => admitted,
        None => burst_during.await,
    };
    tokio::time::sleep(Duration::from_millis(70)).await;
    let after = burst(300).await;
    // The capacity and 70 ms of the rate: before, the key's new bucket fetched the refilled
    // bucket while the 40 were on neither side, and the sweep handed them back on top of it.
    assert_eq!((during, after), (100, 7));
}

#[test]
fn a_hand_back_whose_runtime_ends_on_its_way_does_not_hold_up_its_keys_next_fetch() {
    let paused = common::paused_runtime;
    let first = paused();
    // Hand-backs that would land an hour late: the first runtime ends while one is out. The
    // bucket refills slowly: one refilled around the lease would have it forfeited, not sent.
    let slowly_refilled = Limit::per(100, Duration::from_secs(3_600))
        .burst(100)
        .unwrap();
    let layer = first.block_on(async {
        let late = HeldBack::releases_late(Duration::from_secs(3_600));
        let layer = handing_back_unused_leases(late, slowly_refilled);
        assert_eq!(
            admitted((0..10).map(|_| layer.acquire("k".to_owned(), 1))).await,
            10
        );
        tokio::time::sleep(Duration::from_millis(1_001)).await;
        let key = LeaseKey::new("k".to_owned(), 0, 0);
        let left = layer.local_store().peek_bucket(&key, |b| b.leased_tokens());
        assert_eq!(left, Some(0), "the hand-back of 40 is on its way");
        layer
    });
    drop(first);
    // Its tokens may have reached the store: counted as lost, never sent again.
    assert_eq!(layer.stats().tokens_lost, 40);
    paused().block_on(async {
        let decisions = (0..10).map(|_| layer.acquire("k".to_owned(), 1));
        let burst = tokio::time::timeout(Duration::from_secs(1), admitted(decisions)).await;
        assert_eq!(
            burst,
            Ok(10),
            "the key's fetch did not wait for the lost hand-back"
        );
    });
}

#[tokio::test(start_paused = true)]
async fn a_slow_keys_lease_its_bucket_refilled_around_is_forfeited_without_a_call() {
    // A key far from its limit keeps a small lease unused; its global bucket refills to full
    // meanwhile. Handed back, the lease would be cut by the bucket's capacity: it is forfeited
    // instead, and no call is made for it.
    let layer = HierarchicalThrottleLayer::builder()
        .key(|key: &String| Some(key.clone()))
        .clock(TokioClock::new())
        .limit(Limit::per_second(100).burst(100).unwrap())
        .cold_start(ColdStart::Exact)
        .lease_ttl(Duration::from_millis(100))
        .global_store(MemoryGlobalStore::with_clock(TokioClock::new()))
        .build()
        .unwrap();
    assert_eq!(
        admitted(std::iter::once(layer.acquire("k".to_owned(), 1))).await,
        1
    );
    let before = layer.stats();
    assert!(before.tokens_leased > 1, "a small lease: {before:?}");
    // Kept ten times-to-live, then swept.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = layer.stats();
    assert_eq!(after.global_calls, before.global_calls, "no hand-back sent");
    assert_eq!(after.tokens_returned, 0);
    assert_eq!(after.tokens_forfeited, before.tokens_leased - 1);
    let key = LeaseKey::new("k".to_owned(), 0, 0);
    let left = layer.local_store().peek_bucket(&key, |b| b.leased_tokens());
    assert_eq!(left.unwrap_or(0), 0);
    // The fleet lost nothing by it: a burst gets the whole capacity, and no more.
    let burst = (0..150).map(|_| layer.acquire("k".to_owned(), 1));
    assert_eq!(admitted(burst).await, 100);
}

#[tokio::test(start_paused = true)]
async fn an_evicted_lease_goes_back_less_what_its_bucket_refilled_past_it() {
    // "k" takes the whole bucket (a key near its limit), then spends a burst long after its
    // last use, as the global bucket has refilled around the lease, and a flood of other keys
    // evicts it. Handed back whole, the tokens left would fill the bucket again for the next
    // burst, on top of the one the lease served.
    let capacity = 100;
    let store = MemoryGlobalStore::with_clock(TokioClock::new());
    let layer = evicting_layer(store, evicting_store(), 1.0);
    let burst = |requests| admitted((0..requests).map(|_| layer.acquire("k".to_owned(), 1)));
    let start = tokio::time::Instant::now();
    assert_eq!(burst(1).await, 1);
    // The answer armed the lease: its next use, 1 ms on, finds nothing refilled yet.
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(burst(1).await, 1);
    // At 300 ms the global bucket holds 30 around the 98 the lease holds; 40 at once then.
    tokio::time::sleep_until(start + Duration::from_millis(300)).await;
    assert_eq!(burst(40).await, 40);
    evict_k(&layer).await;
    // A read of the counters collects the evicted bucket at once: by the host's reckoning the
    // global bucket holds 30, around the 99 the lease held at its answer, so 29 of the 58 left
    // are forfeited, and the sweep at 500 ms hands back the other 29.
    let forfeited = layer.stats().tokens_forfeited;
    // A burst at 520 ms: 30 + 29 + 22 refilled since. From 300 ms on, at most the capacity and
    // 220 ms of the rate; handed back whole, the 58 would have filled the bucket (100 in the
    // burst, 140 from 300 ms).
    tokio::time::sleep_until(start + Duration::from_millis(520)).await;
    let after = burst(300).await;
    assert!(40 + after <= capacity + 22, "{after} after the 40");
    assert_eq!(after, 81);
    assert_eq!(forfeited, 29);
    assert_eq!(layer.stats().tokens_returned, 29);
}

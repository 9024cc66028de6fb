//! Credit for cold keys ([`ColdStart::Credit`], the default): a request the host holds no
//! tokens for is decided at once, without waiting for a store a network hop away, and charged
//! behind the response; a fleet admits at most `capacity + rate x t + hosts x credit` per
//! bucket, and the debt of a credit is paid before the key is admitted again.

mod common;

use std::time::Duration;

use common::{Fault, FaultyStore};
use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::global::GlobalStore;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{
    Builder, ColdStart, ConfigError, DefaultRejection, FailurePolicy, HierarchicalThrottleLayer,
    Limit, MemoryGlobalStore, MemoryLocalStore,
};
use tokio::time::Instant;

type Store = FaultyStore<MemoryGlobalStore<String, TokioClock>>;
type Layer = HierarchicalThrottleLayer<String, String, Store, MemoryLocalStore<String>, TokioClock>;
type HostBuilder =
    Builder<String, String, Store, MemoryLocalStore<String>, TokioClock, DefaultRejection>;

/// How long a call nothing waits on (the fetch a credit starts) waits for others to join its
/// batch: the default `global_batch_linger`.
const LINGER: Duration = Duration::from_millis(250);

fn slow_store(delay: Duration) -> Store {
    let store = FaultyStore::new(MemoryGlobalStore::with_clock(TokioClock::new()));
    store.delay(delay);
    store
}

fn host(store: &Store, limit: Limit, cold_start: ColdStart) -> Layer {
    HierarchicalThrottleLayer::builder()
        .key(|k: &String| Some(k.clone()))
        .limit(limit)
        .clock(TokioClock::new())
        .cold_start(cold_start)
        .global_store(store.clone())
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_cold_key_is_decided_at_once_and_an_exact_host_waits_for_the_store() {
    let store = slow_store(Duration::from_millis(5));
    let limit = Limit::per_second(100).burst(100).unwrap();
    let credit = host(&store, limit, ColdStart::default());
    let start = Instant::now();
    assert!(credit.acquire("k".to_owned(), 1).await.is_ok());
    assert_eq!(start.elapsed(), Duration::ZERO, "no round trip");
    assert_eq!(credit.stats().admitted_on_credit, 1);

    let exact = host(&store, limit, ColdStart::Exact);
    let start = Instant::now();
    assert!(exact.acquire("other".to_owned(), 1).await.is_ok());
    assert_eq!(start.elapsed(), Duration::from_millis(5), "one round trip");
    assert_eq!(exact.stats().admitted_on_credit, 0);
}

#[tokio::test(start_paused = true)]
async fn the_batch_of_a_credited_request_pays_for_it() {
    let store = slow_store(Duration::from_millis(5));
    let limit = Limit::per_second(100).burst(100).unwrap();
    let layer = host(&store, limit, ColdStart::default());
    assert!(layer.acquire("k".to_owned(), 1).await.is_ok());
    // The fetch the credit started has answered: its batch paid the token and filled the lease.
    tokio::time::sleep(LINGER + Duration::from_millis(6)).await;
    let bucket = BucketKey::new("k".to_owned(), "default").unwrap();
    let level = store.level(&bucket, &limit).await.unwrap();
    let leased = layer.stats().tokens_leased;
    assert!(leased >= 1, "a batch came");
    assert_eq!(
        level.tokens,
        100 - leased,
        "the store dispensed what the host holds"
    );
    let held: u64 = layer.remaining("k")[0].tokens;
    // The host's view: the global level and its lease, less the token it used.
    assert_eq!(held, 99);
}

#[tokio::test(start_paused = true)]
async fn a_fleet_on_an_exhausted_key_over_admits_at_most_its_credit_and_pays_it_back() {
    let store = slow_store(Duration::from_millis(2));
    // 10 a second, burst 10: one token every 100 ms.
    let limit = Limit::per_second(10).burst(10).unwrap();
    let hosts: Vec<_> = (0..4)
        .map(|_| host(&store, limit, ColdStart::default()))
        .collect();
    // Host 0 takes the whole burst (its first request on credit, the rest waiting for batches).
    let mut admitted = 0;
    for _ in 0..10 {
        admitted += u64::from(hosts[0].acquire("k".to_owned(), 1).await.is_ok());
    }
    assert_eq!(admitted, 10);
    // The three other hosts know nothing yet: each admits one request on credit, charged into
    // debt, and is refused after.
    for host in &hosts[1..] {
        for _ in 0..3 {
            admitted += u64::from(host.acquire("k".to_owned(), 1).await.is_ok());
        }
    }
    let credit = ColdStart::default().credit(&limit);
    assert_eq!(
        admitted,
        10 + 3 * credit,
        "capacity and a credit per other host"
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    let bucket = BucketKey::new("k".to_owned(), "default").unwrap();
    let level = store.level(&bucket, &limit).await.unwrap();
    assert_eq!(level.tokens, 0);
    // The debt (3 tokens) and the next token: 400 ms from the start, less the time gone by.
    assert!(
        level.next_in > Duration::from_millis(300),
        "the debt is owed: {level:?}"
    );
    for host in &hosts {
        assert!(host.acquire("k".to_owned(), 1).await.is_err(), "debt first");
    }
    let stats: Vec<_> = hosts.iter().map(|h| h.stats()).collect();
    assert_eq!(stats.iter().map(|s| s.tokens_uncharged).sum::<u64>(), 0);
}

#[tokio::test(start_paused = true)]
async fn credit_whose_charge_fails_is_counted_and_the_store_back_off_stops_more_credit() {
    let store = slow_store(Duration::from_millis(2));
    store.set(Fault::Error);
    let limit = Limit::per_second(100).burst(100).unwrap();
    let layer = HierarchicalThrottleLayer::builder()
        .key(|k: &String| Some(k.clone()))
        .limit(limit)
        .clock(TokioClock::new())
        .failure_policy(FailurePolicy::Reject)
        .global_store(store.clone())
        .build()
        .unwrap();
    assert!(layer.acquire("k".to_owned(), 1).await.is_ok(), "on credit");
    tokio::time::sleep(LINGER + Duration::from_millis(3)).await;
    let stats = layer.stats();
    assert_eq!((stats.admitted_on_credit, stats.tokens_uncharged), (1, 1));
    // The store backs off: the failure policy decides (here: refuses), not credit.
    assert!(layer.acquire("other".to_owned(), 1).await.is_err());
    assert_eq!(layer.stats().admitted_on_credit, 1);
}

#[tokio::test(start_paused = true)]
async fn a_request_costing_more_than_the_credit_waits_for_its_batch() {
    let store = slow_store(Duration::from_millis(5));
    let limit = Limit::per_second(100).burst(100).unwrap();
    let layer = host(&store, limit, ColdStart::Credit { share: 0.05 });
    let start = Instant::now();
    assert!(layer.acquire("k".to_owned(), 6).await.is_ok());
    assert_eq!(start.elapsed(), Duration::from_millis(5));
    assert!(layer.acquire("k2".to_owned(), 5).await.is_ok());
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(5),
        "within the credit"
    );
}

#[test]
fn a_credit_share_outside_zero_to_one_is_a_configuration_error() {
    let built = HierarchicalThrottleLayer::builder()
        .key(|k: &String| Some(k.clone()))
        .limit(Limit::per_second(10).burst(10).unwrap())
        .cold_start(ColdStart::Credit { share: 1.5 })
        .global_store(MemoryGlobalStore::new())
        .build();
    assert!(matches!(
        built,
        Err(ConfigError::InvalidSetting {
            setting: "cold_start",
            ..
        })
    ));
}

// Global calls that no request waits on (the fetch a credited request starts) linger for others
// to join their batch; a call a request waits on goes at once and takes them along; a request
// that joins a lingering fetch sends it at once.

/// The store's answer time in the tests of lingering calls: a network hop away.
const DELAY: Duration = Duration::from_millis(2);

/// A host giving 1 token of credit (1 % of 100), whose calls nothing waits on linger `linger`;
/// settings on top.
fn lingering(store: &Store, linger: Duration) -> HostBuilder {
    lingering_on(store, linger, Limit::per_second(100).burst(100).unwrap())
}

/// A host of [`lingering`] on `limit`.
fn lingering_on(store: &Store, linger: Duration, limit: Limit) -> HostBuilder {
    HierarchicalThrottleLayer::builder()
        .key(|k: &String| Some(k.clone()))
        .limit(limit)
        .clock(TokioClock::new())
        .global_batch_linger(linger)
        .global_store(store.clone())
}

fn lingering_host(store: &Store, linger: Duration) -> Layer {
    lingering(store, linger).build().unwrap()
}

/// Twenty cold keys, one request each, four at each of 0, 1, 2, 3 and 4 ms (tokio's timers
/// tick in milliseconds), each admitted on credit at once; returns the layer's round trips
/// once every fetch has answered.
async fn twenty_cold_keys(layer: &Layer) -> u64 {
    for k in 0..20 {
        let start = Instant::now();
        assert!(layer.acquire(format!("key-{k}"), 1).await.is_ok());
        assert_eq!(start.elapsed(), Duration::ZERO, "decided on credit");
        if k % 4 == 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    tokio::time::sleep(LINGER + Duration::from_millis(10)).await;
    let stats = layer.stats();
    assert_eq!(stats.admitted_on_credit, 20);
    assert_eq!(stats.global_calls, 20, "one fetch per key");
    assert_eq!(stats.tokens_uncharged, 0, "every credit paid");
    stats.global_batches
}

#[tokio::test(start_paused = true)]
async fn fetches_of_credited_cold_keys_a_few_ms_apart_go_in_one_round_trip() {
    let default = HierarchicalThrottleLayer::builder()
        .key(|k: &String| Some(k.clone()))
        .limit(Limit::per_second(100).burst(100).unwrap())
        .clock(TokioClock::new())
        .global_store(slow_store(DELAY))
        .build()
        .unwrap();
    assert_eq!(
        twenty_cold_keys(&default).await,
        1,
        "the default lingers 250 ms"
    );
    let each_turn = lingering_host(&slow_store(DELAY), Duration::ZERO);
    assert_eq!(
        twenty_cold_keys(&each_turn).await,
        5,
        "without a linger, the calls of one scheduler turn go together"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_that_joins_a_lingering_fetch_sends_it_at_once() {
    let store = slow_store(DELAY);
    let layer = lingering_host(&store, Duration::from_millis(50));
    assert!(layer.acquire("k".to_owned(), 1).await.is_ok(), "on credit");
    // Its fetch is queued, lingering.
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(layer.stats().global_batches, 0);
    // The credit is spent: the next request waits for the fetch, which goes now, not in 49 ms.
    let start = Instant::now();
    assert!(layer.acquire("k".to_owned(), 1).await.is_ok());
    assert_eq!(start.elapsed(), DELAY);
    let stats = layer.stats();
    assert_eq!((stats.global_calls, stats.admitted_after_fetch), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_call_a_request_waits_on_takes_the_lingering_calls_along() {
    let store = slow_store(DELAY);
    let layer = lingering_host(&store, Duration::from_millis(50));
    assert!(
        layer.acquire("cold".to_owned(), 1).await.is_ok(),
        "on credit"
    );
    // A request over the credit waits for its own fetch: both go in one round trip, now.
    let start = Instant::now();
    assert!(layer.acquire("other".to_owned(), 5).await.is_ok());
    assert_eq!(start.elapsed(), DELAY);
    let stats = layer.stats();
    assert_eq!((stats.global_calls, stats.global_batches), (2, 1));
    assert!(stats.tokens_leased >= 2, "both fetches answered");
}

#[tokio::test(start_paused = true)]
async fn a_lingering_batch_has_the_store_timeout_from_when_it_is_sent() {
    let store = slow_store(Duration::from_millis(40));
    let layer = lingering(&store, Duration::from_millis(30))
        .store_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    assert!(layer.acquire("k".to_owned(), 1).await.is_ok(), "on credit");
    // Sent at 30 ms, answered at 70 ms: 40 ms after it left, within the 50 ms time-out.
    tokio::time::sleep(Duration::from_millis(69)).await;
    assert_eq!(layer.stats().tokens_leased, 0, "not answered yet");
    tokio::time::sleep(Duration::from_millis(2)).await;
    let stats = layer.stats();
    assert_eq!(stats.global_timeouts, 0);
    assert!(stats.tokens_leased > 0, "the batch came");
    assert_eq!(stats.tokens_uncharged, 0);
}

#[tokio::test(start_paused = true)]
async fn a_lingering_batch_cut_short_does_not_send_the_next_one_early() {
    let store = slow_store(DELAY);
    let layer = lingering_host(&store, Duration::from_millis(50));
    assert!(layer.acquire("a".to_owned(), 1).await.is_ok(), "on credit");
    // At 10 ms a request waits on its own fetch, which takes the lingering one along.
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(layer.acquire("b".to_owned(), 5).await.is_ok());
    assert_eq!(layer.stats().global_batches, 1);
    // At 20 ms a new credit's fetch lingers until 70 ms, whatever the first linger's timer
    // (due at 50 ms) does.
    tokio::time::sleep(Duration::from_millis(8)).await;
    assert!(layer.acquire("c".to_owned(), 1).await.is_ok(), "on credit");
    tokio::time::sleep(Duration::from_millis(49)).await;
    assert_eq!(layer.stats().global_batches, 1, "at 69 ms, still lingering");
    tokio::time::sleep(Duration::from_millis(2)).await;
    assert_eq!(layer.stats().global_batches, 2, "sent at 70 ms");
}

#[tokio::test(start_paused = true)]
async fn a_full_batch_goes_without_lingering() {
    let store = slow_store(DELAY);
    let layer = lingering(&store, Duration::from_millis(50))
        .global_batch(4)
        .build()
        .unwrap();
    for k in 0..5 {
        assert!(
            layer.acquire(format!("key-{k}"), 1).await.is_ok(),
            "on credit"
        );
    }
    tokio::time::sleep(DELAY + Duration::from_millis(1)).await;
    let stats = layer.stats();
    assert_eq!(stats.global_batches, 1, "the first four, at once");
    assert!(stats.tokens_leased >= 4, "their fetches answered");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        layer.stats().global_batches,
        2,
        "the fifth after its linger"
    );
}

/// 100 tokens refilled in an hour: the global bucket never refills around a lease in these
/// tests (a lease it had refilled around would be forfeited, not handed back).
fn slowly_refilled() -> Limit {
    Limit::per(100, Duration::from_secs(3_600))
        .burst(100)
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_hand_back_lingers_for_a_batch_to_join() {
    let store = slow_store(DELAY);
    let layer = lingering_on(&store, Duration::from_millis(200), slowly_refilled())
        .lease_ttl(Duration::from_millis(100))
        .build()
        .unwrap();
    assert!(layer.acquire("a".to_owned(), 1).await.is_ok(), "on credit");
    // Its fetch goes at 200 ms; the lease it fills, far from the limit, is kept ten
    // times-to-live (until 1.202 s), then a sweep (every 50 ms) hands it back by 1.252 s.
    tokio::time::sleep(Duration::from_millis(1_260)).await;
    let before = layer.stats();
    assert_eq!((before.global_batches, before.tokens_returned), (1, 0));
    // A cold key's fetch, lingering too, goes with the hand-back.
    assert!(layer.acquire("b".to_owned(), 1).await.is_ok(), "on credit");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = layer.stats();
    assert!(after.tokens_returned > 0, "handed back");
    assert!(after.tokens_leased > before.tokens_leased, "b's batch came");
    assert_eq!(after.global_batches, 2, "in one round trip");
}

#[tokio::test(start_paused = true)]
async fn a_sweep_of_many_unhurried_hand_backs_fills_batches_that_go_at_once() {
    let store = slow_store(DELAY);
    let layer = lingering_on(&store, LINGER, slowly_refilled())
        .lease_ttl(Duration::from_millis(100))
        .build()
        .unwrap();
    for k in 0..300 {
        assert!(
            layer.acquire(format!("key-{k}"), 1).await.is_ok(),
            "on credit"
        );
    }
    // The fetches go in batches of 128 at once and the last 44 after the linger (answered by
    // 252 ms); each lease, far from its limit, is kept ten times-to-live, then the sweeps hand
    // back 256 leases by 1.05 s and 44 by 1.3 s. In batches of 128 the first 256 go at once,
    // the rest after their linger: all back by 1.6 s, where 32 at a time, each lingering,
    // would take two seconds more.
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let stats = layer.stats();
    assert_eq!(stats.admitted_on_credit, 300);
    assert_eq!(
        stats.tokens_returned + 300,
        stats.tokens_leased,
        "every lease back: {stats:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_host_alone_admits_exactly_the_capacity_whatever_its_credit() {
    // Credit may exceed what is left only where the host has not heard the bucket's level: a
    // host that last heard it held 4 owes it at most 4, so a burst on one host stops at the
    // capacity, with half or all of it as credit.
    for share in [0.5, 1.0] {
        let store = slow_store(Duration::from_millis(5));
        let limit = Limit::per_hour(10).burst(10).unwrap();
        let layer = host(&store, limit, ColdStart::Credit { share });
        let mut admitted = 0;
        while layer.acquire("k".to_owned(), 1).await.is_ok() {
            admitted += 1;
            assert!(admitted <= 10, "past the capacity with a credit of {share}");
        }
        assert_eq!(admitted, 10, "a credit of {share}");
        assert!(layer.stats().admitted_on_credit > 0);
    }
}

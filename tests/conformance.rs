//! The conformance suites that ship with the crate (`global::conformance`) refuse stores that
//! break their rules: each test wraps the memory store with one rule broken and expects the
//! suite to panic. The memory and Redis stores pass them (in `worked_examples.rs`,
//! `redis.rs` and `in_flight.rs`).

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::conformance::{assert_conformance, assert_slot_conformance};
use hierarchical_throttle::global::slots::{Holding, SlotHold, SlotStore};
use hierarchical_throttle::global::{
    Adjusted, Adjustment, BucketLevel, GlobalStore, Grant, TokenRequest, TokenReturn,
};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{Limit, MemoryGlobalStore};

type Key = BucketKey<String>;

/// The memory store, with one rule broken.
struct Broken {
    inner: MemoryGlobalStore<String, ManualClock>,
    rule: Rule,
    holds: AtomicU64,
}

#[derive(Clone, Copy, PartialEq)]
enum Rule {
    /// Takes hand-backs back whenever they come.
    HandBacksNeverExpire,
    /// Applies operators' changes whenever they come.
    ChangesNeverExpire,
    /// Applies a host's holding even from a call older than its last.
    OlderHoldsApply,
}

impl GlobalStore<Key> for Broken {
    type Error = Infallible;

    fn acquire(
        &self,
        key: &Key,
        limit: &Limit,
        request: TokenRequest,
    ) -> impl Future<Output = Result<Grant, Infallible>> + Send {
        self.inner.acquire(key, limit, request)
    }

    fn release(
        &self,
        key: &Key,
        limit: &Limit,
        back: TokenReturn,
    ) -> impl Future<Output = Result<(), Infallible>> + Send {
        let back = match self.rule {
            Rule::HandBacksNeverExpire => TokenReturn::new(back.tokens),
            _ => back,
        };
        self.inner.release(key, limit, back)
    }

    fn level(
        &self,
        key: &Key,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Infallible>> + Send {
        self.inner.level(key, limit)
    }

    fn adjust(
        &self,
        key: &Key,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> impl Future<Output = Result<Adjusted, Infallible>> + Send {
        let expires = expires.filter(|_| self.rule != Rule::ChangesNeverExpire);
        self.inner.adjust(key, limit, adjustment, expires)
    }
}

impl SlotStore<Key> for Broken {
    type Error = Infallible;

    fn hold(
        &self,
        key: &Key,
        max: u64,
        mut hold: SlotHold,
    ) -> impl Future<Output = Result<Holding, Infallible>> + Send {
        if self.rule == Rule::OlderHoldsApply {
            // Every call looks newer than the host's last.
            hold.seq = self.holds.fetch_add(1, Ordering::Relaxed) + 1;
        }
        self.inner.hold(key, max, hold)
    }
}

/// Whether `suite` panicked on the memory store with `rule` broken.
async fn refused<F>(rule: Rule, suite: impl FnOnce(Broken, ManualClock) -> F) -> bool
where
    F: Future<Output = ()> + Send + 'static,
{
    let clock = ManualClock::new();
    let store = Broken {
        inner: MemoryGlobalStore::with_clock(clock.clone()),
        rule,
        holds: AtomicU64::new(0),
    };
    let run = tokio::spawn(suite(store, clock)).await;
    run.is_err_and(|error| error.is_panic())
}

#[tokio::test]
async fn the_store_suite_refuses_hand_backs_that_never_expire() {
    let suite = async |store, clock| assert_conformance(&store, &clock).await;
    assert!(refused(Rule::HandBacksNeverExpire, suite).await);
}

#[tokio::test]
async fn the_store_suite_refuses_changes_that_never_expire() {
    let suite = async |store, clock| assert_conformance(&store, &clock).await;
    assert!(refused(Rule::ChangesNeverExpire, suite).await);
}

#[tokio::test]
async fn the_slot_suite_refuses_holds_from_older_calls() {
    let suite = async |store, clock| assert_slot_conformance(&store, &clock).await;
    assert!(refused(Rule::OlderHoldsApply, suite).await);
}

#[tokio::test]
async fn each_suite_passes_a_store_whose_broken_rule_is_not_its_own() {
    let global = async |store, clock| assert_conformance(&store, &clock).await;
    assert!(!refused(Rule::OlderHoldsApply, global).await);
    let slots = async |store, clock| assert_slot_conformance(&store, &clock).await;
    assert!(!refused(Rule::HandBacksNeverExpire, slots).await);
}

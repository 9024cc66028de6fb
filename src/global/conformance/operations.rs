//! Operators' changes, batches of calls, reads of a level, and reservations.

use std::time::Duration;

use crate::Limit;
use crate::clock::{Clock, ManualClock};
use crate::global::{Adjustment, GlobalStore, TokenRequest, TokenReturn};
use crate::quota::BucketKey;

use super::Step::{Acquire, Release};
use super::{cases, token_return};

/// An operator's adjustments, exact: drained (a part-refilled token gone too), tokens added
/// up to capacity, removed into debt of at most a capacity (which the refill pays first),
/// drained while in debt (the debt stays), reset (forgiven), a change dropped from the instant
/// it expires, and a bucket never seen drained.
pub(super) async fn assert_adjust_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    let limit = Limit::per(1, Duration::from_millis(3)).burst(4).unwrap();
    let key = BucketKey::new(format!("adjust-{}", clock.now().as_micros()), "default").unwrap();
    let adjust_expiring = async |adjustment, expires| {
        let adjusted = store
            .adjust(&key, &limit, adjustment, expires)
            .await
            .expect("adjust");
        let (level, read) = (adjusted.level, store.level(&key, &limit).await);
        assert_eq!(
            level,
            read.expect("level"),
            "the level after {adjustment:?} is the bucket's"
        );
        let micros = |d: Duration| d.as_micros() as u64;
        let level = (level.tokens, micros(level.next_in), micros(level.full_in));
        (level, adjusted.applied)
    };
    let adjust = async |adjustment| {
        let (level, applied) = adjust_expiring(adjustment, None).await;
        assert!(applied, "{adjustment:?}, which never expires, is applied");
        level
    };
    store
        .acquire(&key, &limit, TokenRequest::now(3, 3))
        .await
        .expect("acquire");
    clock.advance(Duration::from_micros(2_000));
    assert_eq!(
        adjust(Adjustment::Drain).await,
        (0, 3_000, 12_000),
        "drained"
    );
    assert_eq!(adjust(Adjustment::Add(3)).await, (3, 3_000, 3_000), "added");
    assert_eq!(
        adjust(Adjustment::Add(9)).await,
        (4, 0, 0),
        "added past capacity"
    );
    assert_eq!(
        adjust(Adjustment::Remove(100)).await,
        (0, 15_000, 24_000),
        "removed into a capacity of debt"
    );
    clock.advance(Duration::from_micros(3_000));
    assert_eq!(
        adjust(Adjustment::Drain).await,
        (0, 12_000, 21_000),
        "drained in debt"
    );
    assert_eq!(
        adjust_expiring(Adjustment::Reset, Some(clock.now())).await,
        ((0, 12_000, 21_000), false),
        "dropped at the instant it expires, and said so"
    );
    let later = clock.now() + Duration::from_micros(1);
    assert_eq!(
        adjust_expiring(Adjustment::Reset, Some(later)).await,
        ((4, 0, 0), true),
        "applied a microsecond before"
    );
    let fresh = BucketKey::new(format!("adjust-fresh-{}", clock.now().as_micros()), "x").unwrap();
    let adjusted = store
        .adjust(&fresh, &limit, Adjustment::Drain, None)
        .await
        .expect("adjust");
    assert_eq!(
        (adjusted.level.tokens, adjusted.level.full_in),
        (0, Duration::from_millis(12))
    );
}

/// The same cases through [`GlobalStore::call_many`], each step in a batch with calls on other
/// buckets (a fresh one to acquire from, one to release into) before and after it: every
/// answer reaches its own call, and the calls do not disturb each other.
pub(super) async fn assert_batch_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    use crate::global::{Answer, Call};
    use futures_util::StreamExt;
    let other = Limit::per_second(10).burst(10).unwrap();
    for (n, (name, limit, steps, expected)) in cases().into_iter().enumerate() {
        let origin = clock.now();
        let stamp = origin.as_micros();
        let key = BucketKey::new(format!("batch-{n}-{stamp}"), "default").unwrap();
        let mut answers = Vec::new();
        for (s, step) in steps.into_iter().enumerate() {
            let noise = |tag: &str| {
                BucketKey::new(format!("noise-{n}-{s}-{tag}-{stamp}"), "default").unwrap()
            };
            let (after_us, call) = match step {
                Acquire {
                    after_us,
                    min,
                    want,
                } => (
                    after_us,
                    Call::Acquire {
                        key: key.clone(),
                        limit,
                        request: TokenRequest::now(min, want),
                    },
                ),
                Release {
                    after_us,
                    tokens,
                    expires_at_us,
                } => (
                    after_us,
                    Call::Release {
                        key: key.clone(),
                        limit,
                        back: token_return(tokens, expires_at_us, origin),
                    },
                ),
            };
            clock.advance(Duration::from_micros(after_us));
            let calls = vec![
                Call::Acquire {
                    key: noise("a"),
                    limit: other,
                    request: TokenRequest::now(1, 3),
                },
                call,
                Call::Release {
                    key: noise("r"),
                    limit: other,
                    back: TokenReturn::new(4),
                },
            ];
            let mut replies: Vec<_> = store.call_many(calls).collect().await;
            replies.sort_by_key(|(i, _)| *i);
            assert_eq!(replies.len(), 3, "case `{name}`: one answer per call");
            match &replies[0].1 {
                Ok(Answer::Granted(grant)) => {
                    assert_eq!((grant.granted, grant.remaining), (3, 7), "case `{name}`")
                }
                other => panic!("case `{name}`: the fresh bucket answered {other:?}"),
            }
            assert!(
                matches!(replies[2].1, Ok(Answer::Released)),
                "case `{name}`"
            );
            match (&replies[1].1, step) {
                (Ok(Answer::Granted(grant)), Acquire { .. }) => answers.push((
                    grant.granted,
                    grant.remaining,
                    grant.refill_in.as_micros() as u64,
                )),
                (Ok(Answer::Released), Release { .. }) => {}
                (other, step) => panic!("case `{name}`: {step:?} answered {other:?}"),
            }
        }
        assert_eq!(answers, expected, "case `{name}` in batches");
    }
}

/// A bucket whose limit changes keeps its whole tokens, at most the new capacity: a limit
/// raised from one a minute to a hundred a second refills at once at its own rate (it is not
/// held back by the old limit's minute), and one lowered below the level admits its capacity.
/// A bucket that had refilled under the old limit is full under the new one. Each other change
/// here comes at the instant of the bucket's last call: what accrued between that call and the
/// first under the new limit is a store's own (Redis counts it at the new rate, the memory
/// store at the old one).
pub(super) async fn assert_limit_change_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    let slow = Limit::per_minute(1).burst(1).unwrap();
    let fast = Limit::per_second(100).burst(100).unwrap();
    let lowered = Limit::per_minute(6).burst(5).unwrap();
    let key = |name: &str| {
        let origin = clock.now().as_micros();
        BucketKey::new(format!("limit-change-{name}-{origin}"), "default").unwrap()
    };
    let answer = |g: crate::bucket::Grant| (g.granted, g.remaining, g.refill_in.as_micros());
    let raised = key("raised");
    let take = |limit, want| store.acquire(&raised, limit, TokenRequest::now(1, want));
    assert_eq!(answer(take(&slow, 1).await.unwrap()), (1, 0, 60_000_000));
    assert_eq!(
        answer(take(&fast, 100).await.unwrap()),
        (0, 0, 10_000),
        "raised: the next token in 10 ms, not in a minute"
    );
    clock.advance(Duration::from_millis(100));
    assert_eq!(
        answer(take(&fast, 100).await.unwrap()),
        (10, 0, 10_000),
        "raised: 100 ms at 100 a second"
    );
    let lower = key("lowered");
    let take = |limit, want| store.acquire(&lower, limit, TokenRequest::now(1, want));
    assert_eq!(answer(take(&fast, 10).await.unwrap()), (10, 90, 0));
    assert_eq!(
        answer(take(&lowered, 1).await.unwrap()),
        (1, 4, 0),
        "lowered: 5 of the 90 left"
    );
    assert_eq!(
        answer(take(&fast, 100).await.unwrap()),
        (4, 0, 10_000),
        "raised again: the 4 left"
    );
    let refilled = key("refilled");
    let take = |limit, want| store.acquire(&refilled, limit, TokenRequest::now(1, want));
    assert_eq!(answer(take(&slow, 1).await.unwrap()), (1, 0, 60_000_000));
    clock.advance(Duration::from_secs(60));
    assert_eq!(
        answer(take(&fast, 100).await.unwrap()),
        (100, 0, 10_000),
        "refilled under the old limit: the new one's capacity"
    );
}

/// Reading a bucket's level: exact values, for a bucket never seen, emptied, refilling and in
/// debt to a reservation.
pub(super) async fn assert_level_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    let limit = Limit::per(1, Duration::from_millis(3)).burst(4).unwrap();
    let key = BucketKey::new(format!("level-{}", clock.now().as_micros()), "default").unwrap();
    let read = async || {
        let level = store.level(&key, &limit).await.expect("level");
        (
            level.tokens,
            level.next_in.as_micros() as u64,
            level.full_in.as_micros() as u64,
        )
    };
    assert_eq!(read().await, (4, 0, 0), "never seen: full");
    store
        .acquire(&key, &limit, TokenRequest::now(4, 4))
        .await
        .expect("acquire");
    assert_eq!(read().await, (0, 3_000, 12_000), "emptied");
    clock.advance(Duration::from_micros(4_500));
    assert_eq!(read().await, (1, 1_500, 7_500), "refilling");
    let mut reserve = TokenRequest::now(1, 3);
    reserve.max_delay = Duration::from_millis(10);
    let grant = store.acquire(&key, &limit, reserve).await.expect("acquire");
    assert_eq!((grant.granted, grant.reserved), (1, 2));
    assert_eq!(read().await, (0, 7_500, 16_500), "in debt for two tokens");
    clock.advance(Duration::from_micros(16_500));
    assert_eq!(read().await, (4, 0, 0), "full again");
}

/// One reservation step: advance the clock by `after_us`, then acquire (`min`, `want`) with
/// reservations up to `delay_us` ahead.
type Reserve = (u64, u64, u64, u64);

/// (name, limit, steps, expected `(granted, reserved, ready_in_us, remaining, refill_in_us)`).
type ReservationCase = (&'static str, Limit, Vec<Reserve>, Vec<[u64; 5]>);

fn reservation_cases() -> Vec<ReservationCase> {
    let tb = Limit::per(1, Duration::from_millis(3)).burst(4).unwrap();
    vec![
        (
            "reservations queue, each within the delay of the debt before it",
            tb,
            vec![
                (0, 4, 4, 0),
                (1_000, 1, 5, 7_000),
                (0, 1, 5, 7_000),
                (7_999, 1, 1, 0),
                (1, 1, 1, 0),
            ],
            vec![
                [4, 0, 0, 0, 12_000],
                [0, 2, 5_000, 0, 8_000],
                [0, 2, 11_000, 0, 14_000],
                [0, 0, 0, 0, 6_001],
                [0, 0, 0, 0, 6_000],
            ],
        ),
        (
            "tokens there are granted now, the rest reserved",
            Limit::per_second(100).burst(10).unwrap(),
            vec![(0, 8, 8, 0), (0, 1, 10, 50_000), (20_000, 1, 5, 0)],
            vec![
                [8, 0, 0, 2, 60_000],
                [2, 5, 50_000, 0, 60_000],
                [0, 0, 0, 0, 40_000],
            ],
        ),
        (
            "a fractional rate stays exact in debt",
            Limit::per(7, Duration::from_secs(3)).burst(100).unwrap(),
            vec![
                (0, 100, 100, 0),
                (100_000, 1, 50, 2_000_000),
                (5_000_000, 1, 100, 0),
            ],
            vec![
                [100, 0, 0, 0, 42_857_143],
                [0, 4, 1_614_286, 0, 2_042_858],
                [7, 0, 0, 0, 42_858],
            ],
        ),
        (
            "a day's reservation at a thousand per day",
            Limit::per_day(1_000).burst(1_000).unwrap(),
            vec![
                (0, 1_000, 1_000, 0),
                (0, 1, 1_000, 86_400_000_000),
                (0, 1, 1, 0),
            ],
            vec![
                [1_000, 0, 0, 0, 86_400_000_000],
                [0, 1_000, 86_400_000_000, 0, 86_486_400_000],
                [0, 0, 0, 0, 86_486_400_000],
            ],
        ),
    ]
}

/// Runs the reservation cases against `store`, whose time is `clock`.
pub(super) async fn assert_reservation_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    for (n, (name, limit, steps, expected)) in reservation_cases().into_iter().enumerate() {
        let key = BucketKey::new(
            format!("reservation-{n}-{}", clock.now().as_micros()),
            "default",
        )
        .unwrap();
        let mut answers = Vec::new();
        for (after_us, min, want, delay_us) in steps {
            clock.advance(Duration::from_micros(after_us));
            let request = TokenRequest {
                min,
                want,
                max_delay: Duration::from_micros(delay_us),
            };
            let grant = store.acquire(&key, &limit, request).await.expect("acquire");
            answers.push([
                grant.granted,
                grant.reserved,
                grant.ready_in.as_micros() as u64,
                grant.remaining,
                grant.refill_in.as_micros() as u64,
            ]);
        }
        assert_eq!(answers, expected, "case `{name}`");
    }
}

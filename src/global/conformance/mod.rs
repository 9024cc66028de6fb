//! The suite every [`GlobalStore`] must pass: the arithmetic of the memory store (and of
//! Redis's scripts), answer for answer. Behind the `conformance` feature, for stores of your
//! own.
//!
//! [`assert_conformance`] runs acquires, reservations, hand-backs (expired and not), reads,
//! operators' changes (expired and not), a key's limit changed (raised, lowered, and raised
//! after the bucket refilled), batches of calls over many buckets, limits that warm up, and
//! calendar quotas across their resets (with the `tz` feature, in zones across their changes
//! of offset too), against exact expected answers and against the pure
//! [`TokenBucket`](crate::bucket::TokenBucket) in long seeded runs. A store that drifts from it
//! admits more or less than the hosts of a fleet expect of it. [`assert_slot_conformance`]
//! holds a [`SlotStore`](crate::global::slots::SlotStore) of your own to the rules of
//! concurrency slots.
//!
//! The store must keep time by the [`ManualClock`] it is given (Unix time: the clock's reading
//! plus its [`unix_origin`](crate::clock::Clock::unix_origin), zero for a manual clock), as
//! [`MemoryGlobalStore::with_clock`](crate::MemoryGlobalStore::with_clock) and
//! `RedisGlobalStore::with_clock_override` do: the suite moves the clock, forward only, to
//! instants from 1970 to 2036. It writes buckets whose names start with `conformance-`,
//! `batch-`, `noise-`, `reservation-`, `limit-change-`, `level-`, `adjust-`, `warm-`,
//! `emptied-` and `calendar-`: run it on an empty store, or a key space of its own. A mismatch
//! panics with the case's name.
//!
//! ```
//! use hierarchical_throttle::MemoryGlobalStore;
//! use hierarchical_throttle::clock::ManualClock;
//! use hierarchical_throttle::global::conformance::assert_conformance;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // In a `#[tokio::test]` of your store's crate, with your store in place of this one.
//! let clock = ManualClock::new();
//! let store = MemoryGlobalStore::with_clock(clock.clone());
//! assert_conformance(&store, &clock).await;
//! # }
//! ```

use std::time::Duration;

use crate::Limit;
use crate::clock::{Clock, ManualClock};
use crate::global::{GlobalStore, TokenRequest, TokenReturn};
use crate::quota::BucketKey;

mod operations;
mod seeded;
mod slots;

pub use slots::assert_slot_conformance;

use operations::{
    assert_adjust_conformance, assert_batch_conformance, assert_level_conformance,
    assert_limit_change_conformance, assert_reservation_conformance,
};
use seeded::{assert_calendar_conformance, assert_warm_up_conformance};

/// One step: advance the clock by `after_us`, then acquire (`min`, `want`) or release
/// `tokens`, which expire at `expires_at_us` (an absolute time on the case's clock, which
/// starts at zero) if given.
#[derive(Debug, Clone, Copy)]
enum Step {
    Acquire {
        after_us: u64,
        min: u64,
        want: u64,
    },
    Release {
        after_us: u64,
        tokens: u64,
        expires_at_us: Option<u64>,
    },
}

use Step::*;

const fn give(after_us: u64, tokens: u64) -> Step {
    Release {
        after_us,
        tokens,
        expires_at_us: None,
    }
}

/// The hand-back of a step, on a case's clock that started at `origin`.
fn token_return(tokens: u64, expires_at_us: Option<u64>, origin: Duration) -> TokenReturn {
    let expires = expires_at_us.map(|at| origin + Duration::from_micros(at));
    TokenReturn { tokens, expires }
}

const fn take(after_us: u64, min: u64, want: u64) -> Step {
    Acquire {
        after_us,
        min,
        want,
    }
}

/// (name, limit, steps, expected `(granted, remaining, refill_in_us)` of each acquire).
type Case = (&'static str, Limit, Vec<Step>, Vec<(u64, u64, u64)>);

fn cases() -> Vec<Case> {
    let tb = Limit::per(1, Duration::from_millis(3)).burst(4).unwrap();
    let ones = |times_ms: &[u64]| {
        let mut last = 0;
        times_ms
            .iter()
            .map(|&t| {
                let step = take((t - last) * 1000, 1, 1);
                last = t;
                step
            })
            .collect::<Vec<_>>()
    };
    vec![
        (
            "worked example: all conform",
            tb,
            ones(&[0, 0, 0, 2, 3, 6, 9, 12]),
            vec![
                (1, 3, 0),
                (1, 2, 0),
                (1, 1, 0),
                (1, 0, 1000),
                (1, 0, 3000),
                (1, 0, 3000),
                (1, 0, 3000),
                (1, 0, 3000),
            ],
        ),
        (
            "worked example: bursts of four",
            tb,
            ones(&[0, 0, 0, 0, 12, 12, 12, 12]),
            vec![
                (1, 3, 0),
                (1, 2, 0),
                (1, 1, 0),
                (1, 0, 3000),
                (1, 3, 0),
                (1, 2, 0),
                (1, 1, 0),
                (1, 0, 3000),
            ],
        ),
        (
            "worked example: the sixth does not conform",
            tb,
            ones(&[0, 1, 2, 3, 4, 5]),
            vec![
                (1, 3, 0),
                (1, 2, 0),
                (1, 1, 0),
                (1, 1, 0),
                (1, 0, 2000),
                (0, 0, 1000),
            ],
        ),
        (
            "batches between min and want",
            Limit::per_second(10).burst(10).unwrap(),
            vec![
                take(0, 2, 4),
                take(0, 1, 100),
                take(0, 3, 3),
                take(250_000, 3, 3),
                take(50_000, 3, 3),
            ],
            vec![
                (4, 6, 0),
                (6, 0, 100_000),
                (0, 0, 300_000),
                (0, 2, 50_000),
                (3, 0, 300_000),
            ],
        ),
        (
            "released tokens come back, never past capacity",
            Limit::per_minute(60).burst(10).unwrap(),
            vec![
                take(0, 10, 10),
                give(0, 4),
                take(0, 1, 100),
                give(0, 100),
                take(0, 1, 100),
            ],
            vec![(10, 0, 10_000_000), (4, 0, 1_000_000), (10, 0, 1_000_000)],
        ),
        (
            "expired tokens are dropped, others taken back until the instant they expire",
            Limit::per_minute(60).burst(10).unwrap(),
            vec![
                take(0, 10, 10),
                Release {
                    after_us: 5,
                    tokens: 3,
                    expires_at_us: Some(5),
                },
                Release {
                    after_us: 0,
                    tokens: 2,
                    expires_at_us: Some(6),
                },
                take(0, 1, 100),
            ],
            vec![(10, 0, 10_000_000), (2, 0, 999_995)],
        ),
        (
            "a billion tokens at one per day",
            Limit::per_day(1).burst(1_000_000_000).unwrap(),
            vec![
                take(0, 1_000_000_000, 1_000_000_000),
                take(0, 1, 1),
                take(86_399_999_999, 1, 1),
                take(1, 1, 1),
            ],
            // A billion days is past the longest reported wait, 2^53 us.
            vec![
                (1_000_000_000, 0, 1 << 53),
                (0, 0, 86_400_000_000),
                (0, 0, 1),
                (1, 0, 86_400_000_000),
            ],
        ),
        (
            "five million per second",
            Limit::per_second(5_000_000).burst(1_000_000_000).unwrap(),
            vec![
                take(0, 1, 1_000_000_000),
                take(1_000, 1, 1_000_000_000),
                take(1, 6, 6),
            ],
            vec![(1_000_000_000, 0, 1), (5_000, 0, 1), (0, 5, 1)],
        ),
        (
            "seven per three seconds keeps its fractions",
            Limit::per(7, Duration::from_secs(3)).burst(100).unwrap(),
            vec![
                take(0, 100, 100),
                take(1_000_000, 1, 100),
                take(285_714, 1, 1),
                take(1, 1, 1),
                take(1_714_285, 1, 100),
            ],
            // After 1 s: 2 1/3 tokens; the next whole one needs 2/3 * 3/7 s = 285,714.3 us.
            vec![
                (100, 0, 42_857_143),
                (2, 0, 285_715),
                (0, 0, 1),
                (1, 0, 428_571),
                (4, 0, 428_572),
            ],
        ),
        (
            "the largest capacity",
            Limit::per_second(1).burst(Limit::MAX_CAPACITY).unwrap(),
            vec![
                take(0, Limit::MAX_CAPACITY, Limit::MAX_CAPACITY),
                take(2_000_000, 1, 5),
            ],
            vec![(Limit::MAX_CAPACITY, 0, 1 << 53), (2, 0, 1_000_000)],
        ),
    ]
}

/// Runs the whole suite (see the [module](self)) against `store`, whose time is `clock`;
/// panics at the first answer that differs from the expected one, naming its case.
pub async fn assert_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    for (n, (name, limit, steps, expected)) in cases().into_iter().enumerate() {
        let origin = clock.now();
        let key = BucketKey::new(format!("conformance-{n}-{}", origin.as_micros()), "default");
        let key = key.unwrap();
        let mut answers = Vec::new();
        for step in steps {
            match step {
                Acquire {
                    after_us,
                    min,
                    want,
                } => {
                    clock.advance(Duration::from_micros(after_us));
                    let request = TokenRequest::now(min, want);
                    let grant = store.acquire(&key, &limit, request).await.expect("acquire");
                    // A read between steps sees what the acquire left, and changes nothing
                    // (the answers that follow are checked unchanged).
                    let level = store.level(&key, &limit).await.expect("level");
                    assert_eq!(level.tokens, grant.remaining, "case `{name}`");
                    assert!(level.next_in <= level.full_in, "case `{name}`: {level:?}");
                    answers.push((
                        grant.granted,
                        grant.remaining,
                        grant.refill_in.as_micros() as u64,
                    ));
                }
                Release {
                    after_us,
                    tokens,
                    expires_at_us,
                } => {
                    clock.advance(Duration::from_micros(after_us));
                    let back = token_return(tokens, expires_at_us, origin);
                    store.release(&key, &limit, back).await.expect("release");
                }
            }
        }
        assert_eq!(answers, expected, "case `{name}`");
    }
    assert_reservation_conformance(store, clock).await;
    assert_limit_change_conformance(store, clock).await;
    assert_level_conformance(store, clock).await;
    assert_adjust_conformance(store, clock).await;
    assert_batch_conformance(store, clock).await;
    assert_warm_up_conformance(store, clock).await;
    assert_calendar_conformance(store, clock).await;
}

//! Arithmetic cases every global store must answer identically: one suite, run against the
//! in-memory store and against Redis. Times are relative to where the clock stands.

use std::time::Duration;

use hierarchical_throttle::Limit;
use hierarchical_throttle::clock::{Clock, ManualClock};
use hierarchical_throttle::global::{Adjustment, GlobalStore, TokenRequest, TokenReturn};
use hierarchical_throttle::quota::BucketKey;

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
    match expires_at_us {
        Some(at) => TokenReturn::expiring(tokens, origin + Duration::from_micros(at)),
        None => TokenReturn::new(tokens),
    }
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

/// Runs every case against `store`, whose time is `clock`, and checks the expected answers.
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
    assert_level_conformance(store, clock).await;
    assert_adjust_conformance(store, clock).await;
    assert_batch_conformance(store, clock).await;
    assert_warm_up_conformance(store, clock).await;
    assert_calendar_conformance(store, clock).await;
}

/// Calendar quotas: a day's quota taken a second before midnight is whole again at midnight;
/// a month's, taken on the 1st of March 2024, in 31 days; then seeded runs of acquires
/// (with reservations), releases, adjustments and reads over many resets (days at an offset
/// from UTC, weeks, months, and days in zones across their changes of offset), held to the
/// pure bucket's answers step by step. Moves `clock` to 2024 (calendar times are Unix times).
pub async fn assert_calendar_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    use hierarchical_throttle::calendar::Period;
    // 2024-02-28 23:59:59 UTC.
    clock.set(Duration::from_secs(1_709_164_799));
    let daily: Limit = "3 per day at 00:00 UTC".parse().unwrap();
    let key = BucketKey::new("calendar-day".to_owned(), "default").unwrap();
    let take_three = async || {
        let grant = store.acquire(&key, &daily, TokenRequest::now(1, 3)).await;
        let grant = grant.unwrap();
        (grant.granted, grant.refill_in)
    };
    assert_eq!(take_three().await, (3, Duration::from_secs(1)));
    clock.advance(Duration::from_micros(999_999));
    assert_eq!(take_three().await, (0, Duration::from_micros(1)));
    clock.advance(Duration::from_micros(1));
    assert_eq!(take_three().await.0, 3, "whole again on the leap day");
    // A use charged into debt (the next window pays it) leaves a request that reserves nothing
    // with nothing: not the next window's tokens, due the moment the debt is paid.
    let charge = TokenRequest {
        min: 1,
        want: 1,
        max_delay: Duration::from_secs(26 * 3_600),
    };
    let charged = store.acquire(&key, &daily, charge).await.unwrap();
    let day = Duration::from_secs(86_400);
    assert_eq!(
        (charged.granted, charged.reserved, charged.ready_in),
        (0, 1, day)
    );
    let grant = store.acquire(&key, &daily, TokenRequest::now(1, 3)).await;
    let grant = grant.unwrap();
    assert_eq!(
        (grant.granted, grant.reserved, grant.refill_in),
        (0, 0, day)
    );
    // This window's tokens handed back pay its debt first.
    store
        .release(&key, &daily, TokenReturn::new(2))
        .await
        .unwrap();
    assert_eq!(take_three().await, (1, day));
    // 2024-03-01 00:00:00 UTC: the whole of March, 31 days, to the next reset.
    clock.set(Duration::from_secs(1_709_251_200));
    let monthly = Limit::per_calendar(10, Period::Month).build().unwrap();
    let key = BucketKey::new("calendar-month".to_owned(), "default").unwrap();
    let grant = store
        .acquire(&key, &monthly, TokenRequest::now(10, 10))
        .await
        .unwrap();
    assert_eq!(
        (grant.granted, grant.refill_in),
        (10, Duration::from_secs(31 * 86_400))
    );
    let limits = [
        "7 per day at 09:30 UTC+02:00",
        "100 per week",
        "1000 per month at 00:00 UTC-05:00",
    ];
    for (n, limit) in limits.into_iter().enumerate() {
        let limit: Limit = limit.parse().unwrap();
        let period = limit.calendar().unwrap().period();
        let step = match period {
            Period::Day => 10 * 3_600_000_000,
            Period::Week => 2 * 86_400_000_000,
            _ => 9 * 86_400_000_000,
        };
        against_the_model(store, clock, &limit, 100 + n as u64, step).await;
    }
    // Zones whose offset changes (daylight saving time), each run from a day or two before a
    // change over about four days, reset times among the hours the clocks skip or repeat: the
    // script's windows (given the change nearest each call) are the host's. In 2035, past
    // where the runs above leave the clock (it only moves forward).
    let zoned = [
        // 2035-03-23 12:00 UTC: 02:30 is skipped in Paris on the 25th.
        ("5 per day at 02:30 Europe/Paris", 2_058_264_000),
        // 2035-03-30 12:00 UTC: Lord Howe Island goes back half an hour on April 1st.
        ("20 per day at 01:45 Australia/Lord_Howe", 2_058_868_800),
        // 2035-05-29 12:00 UTC: a month in summer time.
        ("50 per month at 00:00 Europe/Paris", 2_064_052_800),
        // 2035-10-26 12:00 UTC: 02:30 comes twice in Paris on the 28th, a day of 25 hours.
        ("5 per day at 02:30 Europe/Paris", 2_077_012_800),
        // 2035-11-02 00:00 UTC: New York's clocks go back on the 4th.
        ("9 per day at 00:00 America/New_York", 2_077_574_400),
    ];
    for (n, (limit, at)) in zoned.into_iter().enumerate() {
        move_to(clock, Duration::from_secs(at));
        let limit: Limit = limit.parse().unwrap();
        against_the_model(store, clock, &limit, 200 + n as u64, 40 * 60_000_000).await;
    }
    // Emptied at each instant around the resets that fall in a skipped or repeated hour: a
    // reset an hour early, late or twice shows in what the next instant gets.
    let minutes = |base: u64, offsets: &[i64]| -> Vec<Duration> {
        let at = |m: i64| Duration::from_secs(base.saturating_add_signed(m * 60));
        offsets.iter().map(|&m| at(m)).collect()
    };
    let around = [
        -31, -30, -29, -1, 0, 1, 15, 29, 30, 31, 59, 60, 61, 89, 90, 91,
    ];
    // 2036-03-30 01:00 UTC (Paris, forward to 03:00) and 2036-10-26 01:00 UTC (back to 02:00).
    for change in [2_090_451_600, 2_108_595_600] {
        let limit: Limit = "2 per day at 02:30 Europe/Paris".parse().unwrap();
        let mut instants = minutes(change, &around);
        instants.extend(minutes(change + 86_400, &around));
        empty_at_each(store, clock, &limit, &instants).await;
    }
}

/// Sets `clock` to `at`, which must be ahead of it (a manual clock never goes back).
fn move_to(clock: &ManualClock, at: Duration) {
    clock.set(at);
    assert_eq!(clock.now(), at, "the clock was already past {at:?}");
}

/// Takes all it can of `limit`'s bucket at each of `instants` (in order), held to the pure
/// bucket's answers: what is granted and when the bucket is next refilled. Every other take
/// goes in a batch of calls (`call_many`: on Redis, the script over many buckets).
async fn empty_at_each<G>(store: &G, clock: &ManualClock, limit: &Limit, instants: &[Duration])
where
    G: GlobalStore<BucketKey<String>>,
{
    use futures_util::StreamExt;
    use hierarchical_throttle::bucket::TokenBucket;
    use hierarchical_throttle::global::{Answer, Call};
    let micros = |d: Duration| d.as_micros() as u64;
    let key = format!("emptied-{}-{}", limit, micros(instants[0]));
    let key = BucketKey::new(key, "d").unwrap();
    let mut model = TokenBucket::full(limit, micros(instants[0]));
    for (n, &at) in instants.iter().enumerate() {
        move_to(clock, at);
        let request = TokenRequest::now(1, limit.capacity());
        let grant = if n % 2 == 0 {
            store.acquire(&key, limit, request).await.expect("acquire")
        } else {
            let limit = *limit;
            let call = Call::Acquire {
                key: key.clone(),
                limit,
                request,
            };
            let replies: Vec<_> = store.call_many(vec![call]).collect().await;
            match replies.into_iter().next() {
                Some((_, Ok(Answer::Granted(grant)))) => grant,
                other => panic!("a batch of one acquire answered {other:?}"),
            }
        };
        let taken = model.take_or_reserve(limit, micros(at), 1, limit.capacity(), 0);
        assert_eq!(
            (grant.granted, micros(grant.refill_in)),
            (taken.granted, taken.refill_in_micros),
            "{limit} at {at:?}"
        );
    }
}

/// Warm-up: Guava's figures (2 per second warming up over 4 s, capacity 1: fully cold, the
/// waits are 1.375, 1.125, 0.875, 0.625 s, then 0.5), then long seeded runs of acquires
/// (with reservations), releases and reads held to the pure bucket's answers, step by step,
/// on rates whose pricing runs past 2^53 in doubles, with an operator's adjustments among them.
pub async fn assert_warm_up_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    let guava = Limit::per_second(2)
        .burst(1)
        .unwrap()
        .warm_up(Duration::from_secs(4))
        .unwrap();
    let key = BucketKey::new(format!("warm-up-{}", clock.now().as_micros()), "default").unwrap();
    let mut waits = Vec::new();
    for after_us in [0, 0, 1_375_000, 1_125_000, 875_000, 625_000, 500_000] {
        clock.advance(Duration::from_micros(after_us));
        let grant = store.acquire(&key, &guava, TokenRequest::now(1, 1)).await;
        let grant = grant.expect("acquire");
        waits.push((grant.granted, grant.refill_in.as_micros() as u64));
    }
    let expected = [
        1_375_000, 1_375_000, 1_125_000, 875_000, 625_000, 500_000, 500_000,
    ];
    let granted = [1, 0, 1, 1, 1, 1, 1];
    assert_eq!(
        waits,
        granted.into_iter().zip(expected).collect::<Vec<_>>(),
        "Guava's warm-up"
    );
    let limits = [
        Limit::per_second(7)
            .burst(5)
            .unwrap()
            .warm_up(Duration::from_millis(2_500))
            .unwrap(),
        Limit::per(7, Duration::from_secs(3))
            .burst(100)
            .unwrap()
            .warm_up(Duration::from_secs(400))
            .unwrap(),
    ];
    for (n, limit) in limits.into_iter().enumerate() {
        against_the_model(store, clock, &limit, n as u64, 900_000).await;
    }
}

/// A seeded run on `limit`, the clock moving up to `step_us` between steps, every answer
/// compared with [`TokenBucket`]'s.
async fn against_the_model<G>(
    store: &G,
    clock: &ManualClock,
    limit: &Limit,
    seed: u64,
    step_us: u64,
) where
    G: GlobalStore<BucketKey<String>>,
{
    use hierarchical_throttle::bucket::{BucketLevel, TokenBucket};
    let key = BucketKey::new(
        format!("warm-model-{seed}-{}", clock.now().as_micros()),
        "d",
    );
    let key = key.unwrap();
    let micros = |d: Duration| d.as_micros() as u64;
    let mut model = TokenBucket::full(limit, micros(clock.now()));
    let mut state = 0x2545_f491_4f6c_dd1d_u64 ^ seed;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for step in 0..300 {
        clock.advance(Duration::from_micros(next() % step_us));
        let now = micros(clock.now());
        let roll = next();
        // Some expire: a moment ago, now, or ahead (a calendar quota's calls at its reset).
        let spread = Duration::from_micros((roll >> 24) % step_us + 1);
        let expires = match (roll >> 4) % 4 {
            0 => None,
            1 => Some(clock.now().saturating_sub(spread)),
            2 => Some(clock.now()),
            _ => Some(clock.now() + spread),
        };
        if roll % 13 == 0 {
            let adjustment = match (roll >> 8) % 4 {
                0 => Adjustment::Reset,
                1 => Adjustment::Drain,
                2 => Adjustment::Add(1 + (roll >> 12) % 7),
                _ => Adjustment::Remove(1 + (roll >> 12) % 7),
            };
            let level = store.adjust(&key, limit, adjustment, expires).await;
            let level = level.expect("adjust");
            model.adjust(limit, now, adjustment, expires);
            assert_eq!(
                level,
                BucketLevel::of(&model, limit, now),
                "{limit} step {step}"
            );
            continue;
        }
        if roll % 5 == 0 {
            let tokens = 1 + roll % 3;
            let back = TokenReturn { tokens, expires };
            store.release(&key, limit, back).await.expect("release");
            model.give_back(limit, now, back);
            continue;
        }
        let (min, want) = (1 + roll % 3, 1 + (roll >> 8) % 9);
        let delay = match (roll >> 16) % 4 {
            0 => (roll >> 20) % 1_500_000,
            1 => (roll >> 20) % 1_000_000_000_000,
            _ => 0,
        };
        let request = TokenRequest {
            min,
            want,
            max_delay: Duration::from_micros(delay),
        };
        let grant = store.acquire(&key, limit, request).await.expect("acquire");
        let taken = model.take_or_reserve(limit, now, min, want, delay);
        let got = (
            grant.granted,
            grant.reserved,
            micros(grant.ready_in),
            grant.remaining,
            micros(grant.refill_in),
        );
        let model_says = (
            taken.granted,
            taken.reserved,
            taken.ready_in_micros,
            taken.remaining,
            taken.refill_in_micros,
        );
        assert_eq!(got, model_says, "{limit} step {step}");
        let level = store.level(&key, limit).await.expect("level");
        assert_eq!(
            level,
            BucketLevel::of(&model, limit, now),
            "{limit} step {step}"
        );
    }
}

/// An operator's adjustments, exact: drained (a part-refilled token gone too), tokens added
/// up to capacity, removed into debt of at most a capacity (which the refill pays first),
/// drained while in debt (the debt stays), reset (forgiven), a change dropped from the instant
/// it expires, and a bucket never seen drained.
pub async fn assert_adjust_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    let limit = Limit::per(1, Duration::from_millis(3)).burst(4).unwrap();
    let key = BucketKey::new(format!("adjust-{}", clock.now().as_micros()), "default").unwrap();
    let adjust_expiring = async |adjustment, expires| {
        let level = store
            .adjust(&key, &limit, adjustment, expires)
            .await
            .expect("adjust");
        let read = store.level(&key, &limit).await.expect("level");
        assert_eq!(
            level, read,
            "the level after {adjustment:?} is the bucket's"
        );
        (
            level.tokens,
            level.next_in.as_micros() as u64,
            level.full_in.as_micros() as u64,
        )
    };
    let adjust = async |adjustment| adjust_expiring(adjustment, None).await;
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
        (0, 12_000, 21_000),
        "dropped at the instant it expires"
    );
    let later = clock.now() + Duration::from_micros(1);
    assert_eq!(
        adjust_expiring(Adjustment::Reset, Some(later)).await,
        (4, 0, 0),
        "applied a microsecond before"
    );
    let fresh = BucketKey::new(format!("adjust-fresh-{}", clock.now().as_micros()), "x").unwrap();
    let level = store
        .adjust(&fresh, &limit, Adjustment::Drain, None)
        .await
        .expect("adjust");
    assert_eq!(
        (level.tokens, level.full_in),
        (0, Duration::from_millis(12))
    );
}

/// The same cases through [`GlobalStore::call_many`], each step in a batch with calls on other
/// buckets (a fresh one to acquire from, one to release into) before and after it: every
/// answer reaches its own call, and the calls do not disturb each other.
pub async fn assert_batch_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    use futures_util::StreamExt;
    use hierarchical_throttle::global::{Answer, Call};
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

/// Reading a bucket's level: exact values, for a bucket never seen, emptied, refilling and in
/// debt to a reservation.
pub async fn assert_level_conformance<G>(store: &G, clock: &ManualClock)
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
pub async fn assert_reservation_conformance<G>(store: &G, clock: &ManualClock)
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

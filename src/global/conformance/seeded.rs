//! Calendar quotas and limits that warm up: exact figures, then long seeded runs held to the
//! pure bucket step by step.

use std::time::Duration;

use crate::Limit;
use crate::clock::{Clock, ManualClock};
use crate::global::{Adjusted, Adjustment, GlobalStore, TokenRequest, TokenReturn};
use crate::quota::BucketKey;

/// Calendar quotas: a day's quota taken a second before midnight is whole again at midnight;
/// a month's, taken on the 1st of March 2024, in 31 days; then seeded runs of acquires
/// (with reservations), releases, adjustments and reads over many resets (days at an offset
/// from UTC, weeks, months, and days in zones across their changes of offset), held to the
/// pure bucket's answers step by step. Moves `clock` to 2024 (calendar times are Unix times).
pub(super) async fn assert_calendar_conformance<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
    use crate::calendar::Period;
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
    #[cfg(feature = "tz")]
    zoned(store, clock).await;
}

/// Days and months in zones whose offset changes (the `tz` feature).
#[cfg(feature = "tz")]
async fn zoned<G>(store: &G, clock: &ManualClock)
where
    G: GlobalStore<BucketKey<String>>,
{
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
#[cfg(feature = "tz")]
fn move_to(clock: &ManualClock, at: Duration) {
    clock.set(at);
    assert_eq!(clock.now(), at, "the clock was already past {at:?}");
}

/// Takes all it can of `limit`'s bucket at each of `instants` (in order), held to the pure
/// bucket's answers: what is granted and when the bucket is next refilled. Every other take
/// goes in a batch of calls (`call_many`: on Redis, the script over many buckets).
#[cfg(feature = "tz")]
async fn empty_at_each<G>(store: &G, clock: &ManualClock, limit: &Limit, instants: &[Duration])
where
    G: GlobalStore<BucketKey<String>>,
{
    use crate::bucket::TokenBucket;
    use crate::global::{Answer, Call};
    use futures_util::StreamExt;
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
pub(super) async fn assert_warm_up_conformance<G>(store: &G, clock: &ManualClock)
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
    use crate::bucket::{BucketLevel, TokenBucket};
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
            let adjusted = store.adjust(&key, limit, adjustment, expires).await;
            let expected = Adjusted::apply(&mut model, limit, now, adjustment, expires);
            assert_eq!(adjusted.expect("adjust"), expected, "{limit} step {step}");
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

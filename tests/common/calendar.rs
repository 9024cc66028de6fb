//! A fleet on a calendar quota across its reset: one scenario, run on the in-memory store and
//! on Redis.

use std::time::Duration;

use hierarchical_throttle::clock::ManualClock;
use hierarchical_throttle::global::GlobalStore;
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{ColdStart, Limit, RejectionReason};

use super::{Outcome, backend, host_builder, host_layers, send};

/// Four hosts on `global`, 2,000 a calendar day, from 10 s before 2024-11-26 00:00 UTC to 10 s
/// after: before midnight each sends a request every 25 ms (1,596 in all, so the hosts hold
/// leases as the day ends), after it one every millisecond (far above what is left). Each
/// window admits at most its 2,000, none of the first day's tokens in the second, and the
/// second nearly all of its own.
pub async fn fleet_crosses_midnight<G>(clock: &ManualClock, global: G)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let midnight = Duration::from_secs(1_732_579_200);
    fleet_crosses_a_reset(clock, global, "2000 per day at 00:00 UTC", midnight).await;
}

/// The same across the end of Paris's day of 25 hours (2024-10-27 23:00 UTC): a host or a
/// store that put the reset an hour early (by the day's morning offset) would start the next
/// window before the run, and admit few after the true reset.
pub async fn fleet_crosses_the_end_of_a_long_day<G>(clock: &ManualClock, global: G)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let midnight = Duration::from_secs(1_730_070_000);
    fleet_crosses_a_reset(
        clock,
        global,
        "2000 per day at 00:00 Europe/Paris",
        midnight,
    )
    .await;
}

/// Four hosts on `global`, 2,000 a window of `limit`, from 10 s before its reset at
/// `midnight` to 10 s after (see [`fleet_crosses_midnight`]).
async fn fleet_crosses_a_reset<G>(clock: &ManualClock, global: G, limit: &str, midnight: Duration)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let start = midnight - Duration::from_secs(10);
    clock.set(start);
    let limit: Limit = limit.parse().unwrap();
    let layers = host_layers(4, clock, &global, limit);
    let mut hosts: Vec<_> = layers
        .iter()
        .map(|l| tower::Layer::layer(l, backend()))
        .collect();
    let (mut before, mut after) = (0u64, 0u64);
    for ms in 1..=20_000u64 {
        let now = start + Duration::from_millis(ms);
        clock.set(now);
        let sends = now >= midnight || ms % 25 == 0;
        for host in hosts.iter_mut().filter(|_| sends) {
            match send(host, "tenant", 1).await {
                Outcome::Served if now < midnight => before += 1,
                Outcome::Served => after += 1,
                _ => {}
            }
        }
        if ms % 500 == 0 {
            for layer in &layers {
                layer.return_unused_leases().await;
            }
        }
    }
    // 399 rounds of four before midnight.
    assert_eq!(
        before, 1_596,
        "every request of the first day is within its quota"
    );
    assert!(after <= 2_000, "over-admission after midnight: {after}");
    assert!(after >= 1_900, "under-admission after midnight: {after}");
}

/// One host on `global`, 10 a day, the day spent 3 s before its midnight: at midnight, 10 ms
/// and 900 ms after it, waiting for the store and on credit, the new day admits its whole 10,
/// and the refusal that follows tells the wait to the next midnight. Just after a reset a host
/// asks for no more than its waiting requests need: what it took beyond them would wait in a
/// hand-back while it refused, telling its clients to come back in a day.
pub async fn a_day_spent_before_midnight_is_whole_just_after<G>(clock: &ManualClock, global: G)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let limit: Limit = "10 per day at 00:00 UTC".parse().unwrap();
    let cases = [ColdStart::Exact, ColdStart::default()]
        .into_iter()
        .flat_map(|cold| [0, 10, 900].map(move |ms| (cold, Duration::from_millis(ms))));
    // Two days later for each case (one to spend, one to admit), the store's clock only ever
    // going forward.
    let midnights = (0..).map(|case| Duration::from_secs(1_732_579_200 + 2 * 86_400 * case));
    for ((cold_start, after), midnight) in cases.zip(midnights) {
        clock.set(midnight - Duration::from_secs(3));
        let layer = host_builder(clock, limit)
            .cold_start(cold_start)
            .global_store(global.clone())
            .build()
            .unwrap();
        let mut host = tower::Layer::layer(&layer, backend());
        let case = format!("{after:?} after midnight, {cold_start:?}");
        let (admitted, _) = admitted_until_refused(&mut host).await;
        assert_eq!(admitted, 10, "the day before, {case}");
        clock.set(midnight + after);
        let (admitted, refused) = admitted_until_refused(&mut host).await;
        assert_eq!(admitted, 10, "{case}");
        let until_next_midnight = Duration::from_secs(86_400) - after;
        let told = Outcome::Refused(RejectionReason::Throttled, Some(until_next_midnight));
        assert_eq!(refused, told, "{case}");
        assert_eq!(layer.stats().tokens_forfeited, 0, "{case}");
    }
}

/// Requests for `job` through `host` until one is refused: how many were served, and the
/// refusal.
async fn admitted_until_refused<S>(host: &mut S) -> (u32, Outcome)
where
    S: tower::Service<super::Job, Response = Outcome, Error = std::convert::Infallible>,
{
    let mut admitted = 0;
    loop {
        match send(host, "job", 1).await {
            Outcome::Served => admitted += 1,
            refused => return (admitted, refused),
        }
        assert!(admitted <= 100, "never refused");
    }
}

//! A fleet on a limit that warms up: one scenario, run on the in-memory store and on Redis.

use std::time::Duration;

use hierarchical_throttle::Limit;
use hierarchical_throttle::bucket::TokenBucket;
use hierarchical_throttle::clock::{Clock, ManualClock};
use hierarchical_throttle::global::GlobalStore;
use hierarchical_throttle::quota::BucketKey;

use super::run_hosts;

/// 100 per second, burst 100, warming up over 10 s.
pub fn limit() -> Limit {
    Limit::per_second(100)
        .burst(100)
        .unwrap()
        .warm_up(Duration::from_secs(10))
        .unwrap()
}

/// The most a cold bucket of `limit` admits in `micros`: one permit at a time, each as soon as
/// the bucket admits it (no schedule admits more).
pub fn most_admitted(limit: &Limit, micros: u64) -> u64 {
    let mut bucket = TokenBucket::full(limit, 0);
    let (mut now, mut admitted) = (0, 0);
    while now <= micros {
        let taken = bucket.take(limit, now, 1, 1);
        admitted += taken.granted;
        if taken.granted == 0 {
            now += taken.refill_in_micros.max(1);
        }
    }
    admitted
}

/// Four hosts on `global` (cold), each sending a request every millisecond for 6 s, far
/// above the rate: the fleet admits no more than a single cold bucket taken one permit at a
/// time as soon as it can (far below the 700 the limit allows warm), and most of that.
pub async fn fleet_warms_up<G>(clock: &ManualClock, global: G)
where
    G: GlobalStore<BucketKey<String>> + Clone,
{
    let limit = limit();
    let start = clock.now();
    let run = run_hosts(4, clock, global, limit, 6, |_, _| 1).await;
    let elapsed = (clock.now() - start).as_micros() as u64;
    let most = most_admitted(&limit, elapsed);
    assert!(run.admitted <= most, "{run:?}, at most {most} warming up");
    assert!(run.admitted * 100 >= most * 95, "{run:?}, {most} possible");
    // Warm, the same 6 s allow 700: the warm-up holds the fleet well below.
    assert_eq!(run.allowed, 700);
    assert!(most < 500, "{most}");
}

//! A lease's batches around a calendar quota's reset: a batch asked for before it serves only
//! the requests that came before it.

use super::tests::{DEADLINE, FOREVER, SECOND, grant, limit, verdicts};
use super::*;
use crate::lease::fetch::*;
use std::time::Duration;
use tokio::sync::oneshot;

/// Queues a request of one token of `limit` at `now`; returns the miss and the verdict's
/// receiver.
fn queue_one(b: &mut LocalBucket, now: u64, limit: &Limit) -> (Miss, oneshot::Receiver<Verdict>) {
    let (waiter, rx) = Waiter::new(1, now, now + DEADLINE);
    (b.miss(1, now, 0, limit, true, 0, FOREVER, || waiter), rx)
}

#[test]
fn a_calendar_batch_asked_for_before_a_reset_serves_only_requests_that_came_before_it() {
    use crate::calendar::Period;
    let daily = Limit::per_calendar(50, Period::Day).build().unwrap();
    let midnight = 1_732_579_200 * SECOND;
    let answer = |sent_at: u64| FetchOutcome::Granted {
        grant: Grant {
            granted: 2,
            reserved: 0,
            ready_in: Duration::ZERO,
            remaining: 40,
            refill_in: Duration::ZERO,
        },
        sent_at,
        from: Name::intern("default"),
        shape: 0,
    };
    let mut b = LocalBucket::default();
    // One waits from 2 ms before midnight, its batch asked for then; another comes 3 ms after.
    let (started, _before) = queue_one(&mut b, midnight - 2_000, &daily);
    let (joined, _after) = queue_one(&mut b, midnight + 3_000, &daily);
    assert_eq!((started, joined), (Miss::StartFetch, Miss::Joined));
    // The batch lands 5 ms after midnight: its tokens may be yesterday's, which only the
    // first may spend. The second waits for a batch of its own day.
    let settled = b.settle(&answer(midnight - 2_000), midnight + 5_000, 0, &daily);
    assert_eq!(verdicts(&settled), vec![(1, Verdict::Admitted)]);
    assert!(settled.refetch);
    assert_eq!(b.waiting(), 1);
    // The next batch, asked for after midnight, serves it.
    let settled = b.settle(&answer(midnight + 5_000), midnight + 9_000, 0, &daily);
    assert_eq!(verdicts(&settled), vec![(1, Verdict::Admitted)]);
    assert!(!settled.refetch);
}

#[test]
fn a_rate_limits_batch_serves_every_request_waiting_when_it_lands() {
    let mut b = LocalBucket::default();
    let (_, _first) = queue_one(&mut b, 0, &limit());
    let (_, _later) = queue_one(&mut b, 3 * SECOND, &limit());
    let settled = b.settle(&grant(2, 0, 0, 0), 3 * SECOND, 0, &limit());
    assert_eq!(
        verdicts(&settled),
        vec![(1, Verdict::Admitted), (1, Verdict::Admitted)]
    );
}

//! The lease after a change made by hand to its global bucket, and how long it remembers a key
//! as short (so that such a change reaches it).

use super::tests::{DEADLINE, FOREVER, grant, limit, on_credit};
use super::*;
use crate::lease::fetch::*;
use std::time::Duration;

#[test]
fn a_key_known_short_is_asked_about_again_when_its_recheck_is_due_and_never_credited() {
    let mut b = LocalBucket::default();
    b.settle(&grant(0, 0, 0, 300), 0, 0, &limit());
    // Remembered for 2 ms after the answer (at 0), with credit of 5 to give.
    let memory = 2_000;
    let miss = |b: &mut LocalBucket, now| {
        let (waiter, _rx) = Waiter::new(1, now, now + DEADLINE);
        b.miss(1, now, 0, &limit(), true, 5, memory, || waiter)
    };
    assert!(matches!(miss(&mut b, 1_999), Miss::Throttled { .. }));
    assert_eq!(b.known_short(1, 1_999, &limit(), memory), Some(300_000));
    assert_eq!(b.known_short(1, 2_000, &limit(), memory), None);
    assert_eq!(miss(&mut b, 2_000), Miss::StartFetch);
    assert_eq!(b.owed(), 0);
}

#[test]
fn an_adjustment_is_known_as_an_answer_and_a_drain_revokes_the_lease() {
    let level = |tokens, next_in_ms| BucketLevel {
        tokens,
        next_in: Duration::from_millis(next_in_ms),
        full_in: Duration::from_millis(next_in_ms * 10),
    };
    let mut b = LocalBucket::default();
    b.settle(&grant(5, 0, 0, 0), 0, 0, &limit());
    assert_eq!(b.adjusted(false, &level(10, 0), 0, 0), 0);
    assert_eq!(b.leased_tokens(), 5, "a reset leaves the lease");
    b.take_leased(5);
    b.settle(&grant(0, 2, 100, 300), 0, 0, &limit());
    assert!(b.known_short(1, 0, &limit(), FOREVER).is_some());
    assert_eq!(b.adjusted(false, &level(10, 0), 0, 0), 0);
    assert_eq!(
        b.known_short(1, 0, &limit(), FOREVER),
        None,
        "no longer known short"
    );
    // A drain revokes reserved tokens too, and the key is known short until its next token,
    // counted from when the call was sent (1 ms), not from its answer (5 ms): no credit
    // meanwhile.
    assert_eq!(b.adjusted(true, &level(0, 50), 1_000, 5_000), 2);
    assert_eq!(b.known_short(1, 5_000, &limit(), FOREVER), Some(51_000));
    assert!(matches!(
        on_credit(&mut b, 1, 5_000, 5).0,
        Miss::Throttled { .. }
    ));
}

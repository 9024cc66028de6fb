//! What a host tells of a key's bucket (the `RateLimit` fields' state): its lease plus the
//! global level at the last answer and the refill since.

use super::tests::{grant, limit};
use super::*;
use crate::lease::fetch::*;
use std::time::Duration;

/// An answer sent and received at `at`: 4 tokens granted, 3 left in the global bucket.
fn four_of_seven_left_at(at: u64) -> FetchOutcome {
    FetchOutcome::Granted {
        grant: Grant {
            granted: 4,
            reserved: 0,
            ready_in: Duration::ZERO,
            remaining: 3,
            refill_in: Duration::ZERO,
        },
        sent_at: at,
        from: Name::intern("default"),
        shape: 0,
    }
}

#[test]
fn a_view_adds_the_lease_to_the_global_level_and_its_refill_since() {
    let limit = limit(); // 10 per second, burst 10
    let mut b = LocalBucket::default();
    assert_eq!(
        b.view(0, &limit, true),
        View::full(&limit),
        "never asked: full"
    );
    b.settle(&four_of_seven_left_at(0), 0, 0, &limit);
    b.take_leased(2);
    let view = b.view(0, &limit, true);
    assert_eq!(view.tokens, 2 + 3);
    assert_eq!(view.next_in, 100_000, "one token every 100 ms");
    assert_eq!(view.full_in, 500_000);
    // 250 ms later the global bucket has refilled two more.
    assert_eq!(b.view(250_000, &limit, true).tokens, 7);
    assert_eq!(b.view(2_000_000, &limit, true), View::full(&limit));
}

#[test]
fn a_view_read_at_a_recent_time_before_the_last_answer_is_of_that_answer() {
    let limit = limit(); // 10 per second, burst 10
    let mut b = LocalBucket::default();
    b.settle(&four_of_seven_left_at(1_000), 1_000, 0, &limit);
    b.take_leased(2);
    // A coarse clock's reading, 10 ms behind the answer: not "short" (its next token due at
    // the time the call was sent), but the lease and the level the answer told.
    assert_eq!(b.view(990, &limit, true), b.view(1_000, &limit, true));
    assert_eq!(b.view(990, &limit, true).tokens, 2 + 3);
}

#[test]
fn a_view_of_a_key_known_short_counts_only_the_lease_until_tokens_are_due() {
    let limit = limit();
    let mut b = LocalBucket::default();
    b.settle(&grant(1, 0, 0, 300), 0, 0, &limit);
    let view = b.view(100_000, &limit, true);
    assert_eq!((view.tokens, view.next_in), (1, 200_000));
    assert_eq!(
        view.full_in,
        200_000 + 800_000,
        "then 8 more at 10 per second"
    );
    assert_eq!(
        b.view(300_000, &limit, true).tokens,
        2,
        "the global bucket's first token"
    );
    assert_eq!(b.view(400_000, &limit, true).tokens, 3);
}

#[test]
fn a_view_while_deciding_alone_says_no_more_than_the_share_holds() {
    let limit = limit(); // 10 per second, burst 10
    let share = Limit::per_second(5).burst(5).unwrap();
    let mut b = LocalBucket::default();
    b.settle(&grant(4, 0, 0, 0), 0, 0, &limit);
    // The store goes down; the host takes 1 from its own (full) bucket of its share.
    assert_eq!(b.take_fallback(&share, 0, 1), 0);
    let view = b.view(0, &limit, false);
    // The lease's 4 and the fallback's 4 are 8 the host can admit; the view, in the share's
    // terms, says its capacity.
    assert_eq!(view.share, Some(share));
    assert_eq!(view.tokens, share.capacity());
    let mut b = LocalBucket::default();
    assert_eq!(b.take_fallback(&share, 0, 3), 0);
    assert_eq!(
        b.view(0, &limit, false).tokens,
        2,
        "below it, what is there"
    );
}

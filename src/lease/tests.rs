use super::*;
use crate::lease::fetch::*;
use std::time::Duration;
use tokio::sync::oneshot;

pub(super) fn limit() -> Limit {
    Limit::per_second(10).burst(10).unwrap()
}

pub(super) const DEADLINE: u64 = 50_000;

/// How long a key known short is remembered: for ever, unless a test says otherwise.
pub(super) const FOREVER: u64 = u64::MAX;

/// `granted` tokens now, `reserved` due in `ready_in_ms`, the next in `refill_in_ms`.
pub(super) fn grant(
    granted: u64,
    reserved: u64,
    ready_in_ms: u64,
    refill_in_ms: u64,
) -> FetchOutcome {
    FetchOutcome::Granted {
        grant: Grant {
            granted,
            reserved,
            ready_in: Duration::from_millis(ready_in_ms),
            remaining: 0,
            refill_in: Duration::from_millis(refill_in_ms),
        },
        sent_at: 0,
        from: Name::intern("default"),
        shape: 0,
    }
}

/// Queues a request of `cost` at `now`; returns the miss and the verdict's receiver.
fn queue(b: &mut LocalBucket, cost: u64, now: u64) -> (Miss, oneshot::Receiver<Verdict>) {
    let (waiter, rx) = Waiter::new(cost, now, now + DEADLINE);
    (
        b.miss(cost, now, 0, &limit(), true, 0, FOREVER, || waiter),
        rx,
    )
}

pub(super) fn verdicts(settled: &Settled) -> Vec<(u64, Verdict)> {
    settled
        .verdicts
        .iter()
        .map(|(w, v)| (w.cost(), *v))
        .collect()
}

#[test]
fn the_hot_part_of_a_bucket_stays_small() {
    assert!(std::mem::size_of::<LocalBucket>() <= 32);
    // Within glibc's 192-byte chunk class (a 184-byte request and its 8-byte header).
    assert!(std::mem::size_of::<Cold>() <= 184);
}

#[test]
fn one_fetch_per_key_and_everyone_waits_for_it() {
    let mut b = LocalBucket::default();
    let (first, _a) = queue(&mut b, 1, 0);
    let (second, _b) = queue(&mut b, 2, 0);
    assert_eq!((first, second), (Miss::StartFetch, Miss::Joined));
    let plan = b.plan(0, 0, &limit(), false, FOREVER).unwrap();
    assert_eq!((plan.needed, plan.room), (3, 10));
    assert_eq!(plan.request(0, Duration::ZERO).want, 3);
}

#[test]
fn a_batch_serves_waiters_in_arrival_order_and_keeps_the_rest() {
    let mut b = LocalBucket::default();
    let _rx: Vec<_> = [3, 1, 2].iter().map(|&c| queue(&mut b, c, 0).1).collect();
    let settled = b.settle(&grant(8, 0, 0, 0), 0, 0, &limit());
    let expected = vec![
        (3, Verdict::Admitted),
        (1, Verdict::Admitted),
        (2, Verdict::Admitted),
    ];
    assert_eq!(verdicts(&settled), expected);
    assert_eq!(b.leased_tokens(), 2);
    assert!(!settled.refetch && !b.is_fetching());
}

#[test]
fn a_partial_grant_throttles_the_key_until_its_next_token() {
    let mut b = LocalBucket::default();
    let _rx: Vec<_> = [2, 1, 3].iter().map(|&c| queue(&mut b, c, 0).1).collect();
    // Two tokens were there; the next is due 100 ms after the call was sent.
    let settled = b.settle(&grant(2, 0, 0, 100), 5_000, 0, &limit());
    // The first fits; the second does not (the first took both); the third needs 3 more
    // from the global bucket: the first at 100 ms, two more at 100 ms each.
    assert_eq!(
        verdicts(&settled),
        vec![
            (2, Verdict::Admitted),
            (1, Verdict::Throttled { until: 100_000 }),
            (3, Verdict::Throttled { until: 300_000 }),
        ]
    );
    // Later arrivals are refused without a global call until the token is due, exactly.
    let (miss, _) = queue(&mut b, 1, 99_999);
    assert_eq!(miss, Miss::Throttled { until: 100_000 });
    let (miss, _) = queue(&mut b, 1, 100_000);
    assert_eq!(miss, Miss::StartFetch);
}

#[test]
fn reserved_tokens_are_used_only_once_due() {
    let mut b = LocalBucket::default();
    let (_, _rx) = queue(&mut b, 1, 0);
    // Refused now, but 5 tokens reserved: due 300 ms after the answer came (at 1 ms).
    let settled = b.settle(&grant(0, 5, 300, 400), 1_000, 0, &limit());
    assert_eq!(
        verdicts(&settled),
        vec![(1, Verdict::Throttled { until: 301_000 })]
    );
    assert_eq!(b.leased_tokens(), 5);
    let (miss, _) = queue(&mut b, 5, 300_999);
    assert_eq!(miss, Miss::Throttled { until: 301_000 });
    // A request needing more than is reserved waits for the global bucket's refill too.
    let (miss, _) = queue(&mut b, 7, 300_999);
    assert_eq!(
        miss,
        Miss::Throttled {
            until: 400_000 + 100_000
        }
    );
    let (miss, _) = queue(&mut b, 5, 301_000);
    assert_eq!(miss, Miss::Admitted);
    assert_eq!(b.leased_tokens(), 0);
}

/// Tokens reserved under a limit since raised fall due by the new limit's refill at the
/// latest (the store pays its debt back at the new rate); a lowered limit delays none.
#[test]
fn reserved_tokens_fall_due_by_a_raised_limit_s_refill() {
    let mut b = LocalBucket::default();
    b.reshape(Name::intern("default"), 1, &limit(), 0);
    let (_, _rx) = queue(&mut b, 1, 0);
    // 2 and then 3 tokens reserved under 10 a second: due at 201 and 301 ms.
    b.settle(&grant(0, 2, 200, 400), 1_000, 0, &limit());
    b.cold_mut().reserved.add(301_000, 3);
    let due = |b: &LocalBucket| b.cold().reserved.all().to_vec();
    assert_eq!(due(&b), [(201_000, 2), (301_000, 3)]);
    // Lowered: the reservations stand as they were.
    let slow = Limit::per_second(1).burst(10).unwrap();
    b.reshape(Name::intern("default"), 2, &slow, 2_000);
    assert_eq!(due(&b), [(201_000, 2), (301_000, 3)]);
    // Raised to 1,000 a second: the first 2 tokens refill by 4 ms, all 5 by 7 ms.
    let fast = Limit::per_second(1_000).burst(10).unwrap();
    b.reshape(Name::intern("default"), 3, &fast, 2_000);
    assert_eq!(due(&b), [(4_000, 2), (7_000, 3)]);
    // The same limit again changes nothing.
    b.reshape(Name::intern("default"), 3, &limit(), 2_000);
    assert_eq!(due(&b), [(4_000, 2), (7_000, 3)]);
}

/// A bucket waiting for tokens it reserved is not evicted: one made afresh would reserve again
/// behind them (seed 74681 of the simulation: a key over its limit, evicted again and again by
/// a key spray, queued forty reservations and told waits of seconds).
#[test]
fn a_bucket_waiting_for_reserved_tokens_may_not_be_evicted() {
    let mut b = LocalBucket::default();
    assert!(b.may_evict());
    let (_, _rx) = queue(&mut b, 1, 0);
    assert!(!b.may_evict(), "fetching");
    b.settle(&grant(0, 5, 300, 400), 1_000, 0, &limit());
    assert!(!b.is_fetching());
    assert!(!b.may_evict(), "5 tokens reserved, due at 301 ms");
    let (miss, _) = queue(&mut b, 1, 301_000);
    assert_eq!(miss, Miss::Admitted);
    assert!(b.may_evict(), "the reserved tokens came");
}

#[test]
fn a_full_grant_keeps_late_joiners_for_the_next_batch() {
    let mut b = LocalBucket::default();
    let (_, _a) = queue(&mut b, 1, 0);
    b.plan(0, 0, &limit(), false, FOREVER);
    let (_, _b) = queue(&mut b, 1, 0);
    let settled = b.settle(&grant(1, 0, 0, 0), 0, 0, &limit());
    assert_eq!(verdicts(&settled), vec![(1, Verdict::Admitted)]);
    assert!(settled.refetch && b.is_fetching());
    assert_eq!(
        b.plan(0, 0, &limit(), false, FOREVER).map(|p| p.needed),
        Some(1)
    );
}

#[test]
fn a_waiter_asks_again_until_its_deadline_then_is_refused() {
    let mut b = LocalBucket::default();
    let (_, _rx) = queue(&mut b, 5, 0);
    for now in [0, DEADLINE - 1] {
        let settled = b.settle(&grant(1, 0, 0, 0), now, 0, &limit());
        assert!(settled.refetch && settled.verdicts.is_empty());
    }
    let settled = b.settle(&grant(1, 0, 0, 0), DEADLINE, 0, &limit());
    // Three tokens held; the global bucket's next is due now, the one after 100 ms later.
    assert_eq!(
        verdicts(&settled),
        vec![(
            5,
            Verdict::Throttled {
                until: DEADLINE + 100_000
            }
        )]
    );
    assert!(!settled.refetch && !b.is_fetching());
}

#[test]
fn a_failed_fetch_leaves_every_waiter_to_the_failure_policy() {
    let mut b = LocalBucket::default();
    let _rx: Vec<_> = [1, 1].iter().map(|&c| queue(&mut b, c, 0).1).collect();
    let settled = b.settle(&FetchOutcome::Failed, 0, 0, &limit());
    assert_eq!(
        verdicts(&settled),
        vec![(1, Verdict::Failed), (1, Verdict::Failed)]
    );
    assert!(!b.is_fetching());
    // The next request starts a new fetch.
    assert_eq!(queue(&mut b, 1, 0).0, Miss::StartFetch);
}

#[test]
fn a_waiter_that_went_away_takes_nothing() {
    let mut b = LocalBucket::default();
    let (_, gone) = queue(&mut b, 4, 0);
    let (_, _stays) = queue(&mut b, 1, 0);
    drop(gone);
    assert_eq!(
        b.plan(0, 0, &limit(), false, FOREVER).map(|p| p.needed),
        Some(1)
    );
    let settled = b.settle(&grant(5, 0, 0, 0), 0, 0, &limit());
    assert_eq!(verdicts(&settled), vec![(1, Verdict::Admitted)]);
    assert_eq!(b.leased_tokens(), 4);
}

#[test]
fn no_new_fetch_while_the_store_backs_off() {
    let mut b = LocalBucket::default();
    let (waiter, _rx) = Waiter::new(1, 0, DEADLINE);
    assert_eq!(
        b.miss(1, 0, 0, &limit(), false, 0, FOREVER, || waiter),
        Miss::StoreDown
    );
    assert!(!b.is_fetching());
}

#[test]
fn the_lease_runs_low_once_per_batch() {
    let mut b = LocalBucket::default();
    let (_, _rx) = queue(&mut b, 1, 0);
    b.settle(&grant(8, 0, 0, 0), 0, 0, &limit());
    // 7 left, low water 4: the fourth hit leaves 3 and asks for one prefetch.
    let hits: Vec<_> = (0..5).map(|_| b.take_leased(1)).collect();
    assert_eq!(
        hits,
        [
            Hit::Admitted,
            Hit::Admitted,
            Hit::Admitted,
            Hit::AdmittedStartFetch,
            Hit::Admitted
        ]
    );
    assert_eq!(b.take_leased(5), Hit::Short);
}

#[test]
fn a_lowered_limit_sheds_what_the_lease_holds_beyond_it() {
    let mut b = LocalBucket::default();
    let (_, _rx) = queue(&mut b, 1, 0);
    b.settle(&grant(10, 0, 0, 0), 0, 0, &limit());
    let (_, _rx) = queue(&mut b, 20, 0);
    let lower = Limit::per_second(4).burst(4).unwrap();
    let settled = b.settle(&grant(1, 0, 0, 0), 0, 0, &lower);
    // The grant (the bucket's last token) would put the two past the new capacity: taken back.
    assert_eq!((settled.excess, settled.forfeited), (5, 1));
    assert_eq!(b.leased_tokens(), 4);
}

/// Seed 28503: refunds filled the lease past capacity while requests waited, so no batch
/// was asked for; those the lease could not serve were refused though the global bucket
/// held their tokens. They wait for the next batch instead.
#[test]
fn a_lease_filled_by_refunds_serves_what_it_can_and_asks_for_the_rest() {
    let limit = limit();
    let mut b = LocalBucket::default();
    let (first, _a) = queue(&mut b, 5, 0);
    let (_, _b) = queue(&mut b, 5, 0);
    let (_, _c) = queue(&mut b, 5, 0);
    assert_eq!(first, Miss::StartFetch);
    b.give_back(12, u64::MAX);
    assert!(
        b.plan(0, 0, &limit, false, FOREVER).is_none(),
        "a full lease asks for nothing"
    );
    let settled = b.settle(&FetchOutcome::Skipped, 0, 0, &limit);
    let verdicts: Vec<_> = settled.verdicts.iter().map(|(_, v)| *v).collect();
    assert_eq!(verdicts, [Verdict::Admitted, Verdict::Admitted]);
    assert!(settled.refetch, "the third waits for a batch");
    assert_eq!(b.waiting(), 1);
    assert_eq!(
        b.plan(0, 0, &limit, false, FOREVER).map(|p| p.needed),
        Some(5)
    );
}

#[test]
fn leases_expire_unless_a_batch_is_in_flight_or_reserved() {
    let mut b = LocalBucket::default();
    let (_, _rx) = queue(&mut b, 1, 0);
    b.settle(&grant(6, 0, 0, 0), 0, 0, &limit());
    assert_eq!(b.take_expired(1_999_999, 2_000_000, true, 1), 0);
    assert_eq!(b.take_expired(2_000_000, 2_000_000, true, 2), 5);
    assert_eq!(b.leased_tokens(), 0);
}

pub(super) const SECOND: u64 = 1_000_000;

#[test]
fn a_quiet_bucket_sheds_its_slow_path_state_and_reads_the_same() {
    let limit = limit();
    let mut b = LocalBucket::default();
    assert!(
        !b.holds_cold_state(),
        "a new bucket holds only its hot fields"
    );
    let (_, _rx) = queue(&mut b, 1, 0);
    // Four granted, one to the waiter; the global bucket is left empty, full at 1 s.
    b.settle(&grant(4, 0, 0, 0), 0, 0, &limit);
    assert!(b.holds_cold_state());
    assert_eq!(b.take_expired(2 * SECOND, 2 * SECOND, true, 2), 3);
    // The token served is recorded when it was served, as interval 0's demand, which the
    // window holds until interval 16.
    assert_eq!(b.take_expired(15 * SECOND, 2 * SECOND, true, 15), 0);
    assert!(b.holds_cold_state(), "demand is left in the window");
    assert_eq!(b.take_expired(16 * SECOND, 2 * SECOND, true, 16), 0);
    assert!(!b.holds_cold_state(), "nothing left to keep");
    assert_eq!(b.view(16 * SECOND, &limit, true), View::full(&limit));
    assert_eq!(b.known_short(1, 16 * SECOND, &limit, FOREVER), None);
}

#[test]
fn a_bucket_keeps_its_slow_path_state_while_anything_is_left() {
    let limit = limit();
    // Throttled: the global bucket's next token is due at 30 s.
    let mut b = LocalBucket::default();
    let (_, _rx) = queue(&mut b, 1, 0);
    b.settle(&grant(0, 0, 0, 30_000), 0, 0, &limit);
    assert_eq!(b.take_expired(29 * SECOND, 2 * SECOND, true, 29), 0);
    assert!(b.holds_cold_state(), "the key is throttled until 30 s");
    assert_eq!(
        b.known_short(1, 29 * SECOND, &limit, FOREVER),
        Some(30 * SECOND)
    );
    // Its first token comes at 30 s, the bucket is full nine tenths of a second later.
    b.take_expired(30 * SECOND + 899_999, 2 * SECOND, true, 30);
    assert!(b.holds_cold_state(), "the fleet estimate is short of full");
    assert!(b.view(30 * SECOND + 899_999, &limit, true).tokens < limit.capacity());
    b.take_expired(30 * SECOND + 900_000, 2 * SECOND, true, 30);
    assert!(!b.holds_cold_state());

    // A bucket that used its own fallback bucket (store down) keeps it until it is full
    // again: a token a second, 2 of 4 taken at 0 s, full at 2 s.
    let share = Limit::per_second(1).burst(4).unwrap();
    let mut b = LocalBucket::default();
    assert_eq!(b.take_fallback(&share, 0, 2), 0);
    b.take_expired(2 * SECOND - 1, SECOND, true, 0);
    assert!(b.holds_cold_state(), "the fallback bucket is refilling");
    b.take_expired(2 * SECOND, SECOND, true, 0);
    assert!(
        !b.holds_cold_state(),
        "a full fallback bucket is the same as none"
    );
    assert_eq!(
        b.take_fallback(&share, 2 * SECOND, 4),
        0,
        "it starts full again"
    );
    assert_eq!(b.take_fallback(&share, 2 * SECOND, 1), SECOND);

    // Tokens reserved ahead, or a lease not yet expired, are kept.
    let mut b = LocalBucket::default();
    let (_, _rx) = queue(&mut b, 1, 0);
    b.settle(&grant(1, 2, 40_000, 0), 0, 0, &limit);
    assert_eq!(b.take_expired(20 * SECOND, 2 * SECOND, true, 20), 0);
    assert!(b.holds_cold_state(), "reserved tokens are held");
    assert_eq!(b.leased_tokens(), 2);
}

/// Seed 26693: a limit lowered below a waiting request's cost, on a lease already full under
/// the new limit. No batch could ever serve the request; kept for another, it was asked for
/// again at once, forever. It is refused instead.
#[test]
fn a_waiter_costing_more_than_a_lowered_limit_is_refused_not_kept() {
    let mut b = LocalBucket::default();
    let (_, _first) = queue(&mut b, 1, 0);
    b.settle(&grant(3, 0, 0, 0), 0, 0, &limit());
    let (_, _rx) = queue(&mut b, 3, 0);
    let lower = Limit::per_second(2).burst(2).unwrap();
    assert!(
        b.plan(0, 0, &lower, false, FOREVER).is_none(),
        "the lease is full under the new limit"
    );
    let settled = b.settle(&FetchOutcome::Skipped, 0, 0, &lower);
    assert_eq!(verdicts(&settled), vec![(3, Verdict::CostAboveCapacity)]);
    assert!(!settled.refetch && !b.is_fetching());
}

/// A request of `cost` at `now` on `credit` tokens of credit (store up); the verdict's receiver
/// if it queued.
pub(super) fn on_credit(
    b: &mut LocalBucket,
    cost: u64,
    now: u64,
    credit: u64,
) -> (Miss, oneshot::Receiver<Verdict>) {
    let (waiter, rx) = Waiter::new(cost, now, now + DEADLINE);
    (
        b.miss(cost, now, 0, &limit(), true, credit, FOREVER, || waiter),
        rx,
    )
}

#[test]
fn a_cold_bucket_admits_on_credit_and_its_batch_pays_first() {
    let mut b = LocalBucket::default();
    let (miss, _) = on_credit(&mut b, 1, 0, 1);
    assert_eq!(miss, Miss::Credited { start_fetch: true });
    assert_eq!(b.owed(), 1);
    assert!(b.is_fetching());
    // The credit is spent: the next request waits for the batch, which asks for both.
    let (miss, _rx) = on_credit(&mut b, 1, 0, 1);
    assert_eq!(miss, Miss::Joined);
    let plan = b.plan(0, 0, &limit(), false, FOREVER).unwrap();
    assert_eq!(plan.needed, 2);
    assert_eq!(plan.room, 11, "the lease's room and what it owes");
    let settled = b.settle(&grant(5, 0, 0, 0), 0, 0, &limit());
    assert_eq!(verdicts(&settled), vec![(1, Verdict::Admitted)]);
    assert_eq!((settled.unpaid, settled.uncharged), (0, 0));
    assert_eq!((b.owed(), b.leased_tokens()), (0, 3));
}

#[test]
fn credit_takes_the_last_leased_tokens_first_and_owes_only_what_they_lack() {
    let mut b = LocalBucket::default();
    b.settle(&grant_leaving(2, 8), 0, 0, &limit());
    let (miss, _) = on_credit(&mut b, 3, 0, 1);
    assert_eq!(miss, Miss::Credited { start_fetch: true });
    assert_eq!((b.owed(), b.leased_tokens()), (1, 0));
    // A cost whose shortfall is above the credit waits.
    let mut c = LocalBucket::default();
    assert_eq!(on_credit(&mut c, 3, 0, 2).0, Miss::StartFetch);
    assert_eq!(c.owed(), 0);
}

#[test]
fn no_credit_while_the_key_is_known_short_the_store_is_down_or_a_request_waits() {
    let mut b = LocalBucket::default();
    b.settle(&grant(0, 0, 0, 300), 0, 0, &limit());
    assert!(matches!(
        on_credit(&mut b, 1, 0, 5).0,
        Miss::Throttled { .. }
    ));
    let mut down = LocalBucket::default();
    let (waiter, _rx) = Waiter::new(1, 0, DEADLINE);
    assert_eq!(
        down.miss(1, 0, 0, &limit(), false, 5, FOREVER, || waiter),
        Miss::StoreDown
    );
    assert_eq!(down.owed(), 0);
    // A request queued first (its cost was above the credit) is not overtaken.
    let mut queued = LocalBucket::default();
    assert_eq!(on_credit(&mut queued, 3, 0, 2).0, Miss::StartFetch);
    assert_eq!(on_credit(&mut queued, 1, 0, 2).0, Miss::Joined);
}

#[test]
fn reserved_tokens_pay_what_granted_ones_cannot() {
    let mut b = LocalBucket::default();
    on_credit(&mut b, 2, 0, 2);
    let settled = b.settle(&grant(1, 3, 200, 0), 0, 0, &limit());
    assert_eq!(settled.unpaid, 0);
    assert_eq!(b.owed(), 0);
    // One granted and one reserved paid the credit; two reserved tokens stay ahead.
    assert_eq!(b.leased_tokens(), 2);
}

#[test]
fn credit_an_answer_cannot_pay_is_charged_and_blocks_credit_until_charged() {
    let mut b = LocalBucket::default();
    on_credit(&mut b, 1, 0, 1);
    // The global bucket was empty: nothing paid, the next token due in 300 ms.
    let settled = b.settle(&grant(0, 0, 0, 300), 0, 0, &limit());
    assert_eq!((settled.unpaid, settled.uncharged), (1, 0));
    assert_eq!(b.owed(), 0, "handed to the caller to charge");
    assert!(
        b.is_fetching(),
        "not evictable while the charge is under way"
    );
    // Once the key is no longer known short, still no credit while the charge runs.
    assert_eq!(on_credit(&mut b, 1, 400_000, 1).0, Miss::StartFetch);
    b.settle(&grant_leaving(1, 5), 400_000, 0, &limit());
    b.end_charge();
    b.take_leased(1);
    assert_eq!(
        on_credit(&mut b, 1, 400_000, 1).0,
        Miss::Credited { start_fetch: true }
    );
}

#[test]
fn a_batch_answered_while_credit_is_charged_does_not_let_credit_go_again() {
    let mut b = LocalBucket::default();
    on_credit(&mut b, 1, 0, 1);
    assert_eq!(b.settle(&grant(0, 0, 0, 300), 0, 0, &limit()).unpaid, 1);
    // While the charge is under way, a batch finds the bucket short for 3 ms.
    assert_eq!(on_credit(&mut b, 1, 400_000, 1).0, Miss::StartFetch);
    b.settle(&grant(0, 0, 0, 3), 400_000, 0, &limit());
    assert_eq!(
        on_credit(&mut b, 1, 410_000, 1).0,
        Miss::StartFetch,
        "the debt may not be charged yet"
    );
    b.settle(&grant(1, 0, 0, 0), 410_000, 0, &limit());
    b.take_leased(1);
    // The charge's answer: the debt is recovered 5 ms after it came.
    let charge = Grant {
        granted: 0,
        reserved: 1,
        ready_in: Duration::from_millis(5),
        remaining: 0,
        refill_in: Duration::from_millis(5),
    };
    b.note_charge(&charge, 410_000, 411_000, &limit());
    b.end_charge();
    assert_eq!(on_credit(&mut b, 1, 415_000, 1).0, Miss::StartFetch);
    b.settle(&grant_leaving(1, 5), 415_000, 0, &limit());
    b.take_leased(1);
    assert_eq!(
        on_credit(&mut b, 1, 416_000, 1).0,
        Miss::Credited { start_fetch: true }
    );
}

#[test]
fn credit_never_goes_beyond_what_the_global_bucket_holds_by_the_last_answer() {
    // The last answer left 2 in the global bucket: a host owes it at most 2, whatever its
    // credit (more would be admitted past the bucket for certain, on one host as on many).
    let mut b = LocalBucket::default();
    b.settle(&grant_leaving(0, 2), 0, 0, &limit());
    let credited = |start_fetch| Miss::Credited { start_fetch };
    assert_eq!(on_credit(&mut b, 1, 0, 5).0, credited(true));
    assert_eq!(on_credit(&mut b, 1, 0, 5).0, credited(false));
    let (third, _rx) = on_credit(&mut b, 1, 0, 5);
    assert_eq!(third, Miss::Joined);
    assert_eq!(b.owed(), 2);
    // Short at its answer, its next token due in 100 ms (10 a second): then one of credit,
    // and one more for each token refilled since.
    let mut c = LocalBucket::default();
    c.settle(&grant(0, 0, 0, 100), 0, 0, &limit());
    assert_eq!(on_credit(&mut c, 1, 100_000, 5).0, credited(true));
    let (second, _rx) = on_credit(&mut c, 1, 100_000, 5);
    assert_eq!(second, Miss::Joined);
    let mut d = LocalBucket::default();
    d.settle(&grant(0, 0, 0, 100), 0, 0, &limit());
    assert_eq!(on_credit(&mut d, 2, 200_000, 5).0, credited(true));
    // No answer yet: the credit alone bounds it.
    let mut fresh = LocalBucket::default();
    assert_eq!(on_credit(&mut fresh, 5, 0, 5).0, credited(true));
}

#[test]
fn credit_of_a_failed_fetch_or_a_lost_limit_is_uncharged() {
    let mut b = LocalBucket::default();
    on_credit(&mut b, 1, 0, 1);
    let failed = b.fail_fetch();
    assert_eq!((failed.uncharged, b.owed()), (1, 0));
    assert!(!b.is_fetching());
    let mut c = LocalBucket::default();
    on_credit(&mut c, 1, 0, 1);
    assert_eq!(c.drop_limit().uncharged, 1);
}

#[test]
fn tokens_given_back_pay_the_credit_first() {
    let mut b = LocalBucket::default();
    on_credit(&mut b, 1, 0, 1);
    // Another bucket of the request refused it: undoing the take pays what it owed.
    b.undo_take(1, u64::MAX);
    assert_eq!((b.owed(), b.leased_tokens()), (0, 0));
    let settled = b.settle(&grant(3, 0, 0, 0), 0, 0, &limit());
    assert_eq!(settled.unpaid, 0);
    assert_eq!(b.leased_tokens(), 3);
}

#[test]
fn a_bucket_that_moves_tiers_drops_its_credit_as_uncharged() {
    let mut b = LocalBucket::default();
    b.reshape(Name::intern("default"), 1, &limit(), 0);
    on_credit(&mut b, 1, 0, 1);
    let reshaped = b.reshape(Name::intern("tier2"), 2, &limit(), 0);
    assert_eq!(reshaped.uncharged, 1);
    assert_eq!(b.owed(), 0);
}

/// An answer granting `granted` tokens that left `remaining` in the global bucket.
pub(crate) fn grant_leaving(granted: u64, remaining: u64) -> FetchOutcome {
    FetchOutcome::Granted {
        grant: Grant {
            granted,
            reserved: 0,
            ready_in: Duration::ZERO,
            remaining,
            refill_in: Duration::ZERO,
        },
        sent_at: 0,
        from: Name::intern("default"),
        shape: 0,
    }
}

#[test]
fn a_key_far_from_its_limit_asks_for_what_its_lease_may_keep() {
    let limit = Limit::per_second(160).burst(160).unwrap();
    let mut b = LocalBucket::default();
    // Never answered: the global bucket starts full, so a sixteenth of it.
    assert_eq!(b.plan(0, 0, &limit, false, FOREVER).unwrap().keep, 10);
    b.settle(&grant_leaving(10, 150), 0, 0, &limit);
    b.take_up_to(10);
    assert_eq!(b.plan(0, 0, &limit, false, FOREVER).unwrap().keep, 10);
    // Near its limit (under half left): only what demand asks for.
    b.settle(&grant_leaving(5, 79), 0, 0, &limit);
    b.take_up_to(5);
    assert_eq!(b.plan(0, 0, &limit, false, FOREVER).unwrap().keep, 0);
}

#[test]
fn a_small_lease_of_a_key_far_from_its_limit_outlives_its_ttl_for_a_while() {
    let limit = Limit::per_second(160).burst(160).unwrap();
    let ttl = 1_000_000;
    let mut b = LocalBucket::default();
    b.settle(&grant_leaving(25, 135), 0, 0, &limit);
    assert_eq!(b.take_expired(ttl - 1, ttl, true, 0), 0);
    // Past its time-to-live, all but a sixteenth of the capacity goes back...
    assert_eq!(b.take_expired(ttl, ttl, true, 0), 15);
    assert_eq!(b.leased_tokens(), 10);
    // ...and the rest once unused for ten times-to-live.
    assert_eq!(b.take_expired(10 * ttl - 1, ttl, true, 0), 0);
    assert_eq!(b.take_expired(10 * ttl, ttl, true, 0), 10);
}

#[test]
fn a_host_that_keeps_no_small_leases_hands_back_a_far_key_s_whole_lease_at_its_ttl() {
    let limit = Limit::per_second(160).burst(160).unwrap();
    let ttl = 1_000_000;
    let mut b = LocalBucket::default();
    b.settle(&grant_leaving(25, 135), 0, 0, &limit);
    assert_eq!(b.take_expired(ttl - 1, ttl, false, 0), 0);
    // Still far from its limit (the sweeper reads it first): its hand-back may linger.
    assert!(b.is_far_from_limit());
    assert_eq!(b.take_expired(ttl, ttl, false, 0), 25);
    assert_eq!(b.leased_tokens(), 0);
}

#[test]
fn a_lease_of_a_key_near_its_limit_goes_back_whole_at_its_ttl() {
    let limit = Limit::per_second(160).burst(160).unwrap();
    let ttl = 1_000_000;
    let mut b = LocalBucket::default();
    b.settle(&grant_leaving(25, 40), 0, 0, &limit);
    assert_eq!(b.take_expired(ttl, ttl, true, 0), 25);
}

#[test]
fn a_key_over_its_limit_asks_for_its_next_reservation_once_the_last_has_come() {
    let limit = limit(); // 10 per second
    let mut b = LocalBucket::default();
    // Nothing there; 3 tokens reserved, due in 300 ms; the next free token in 400 ms.
    b.settle(&grant(0, 3, 300, 400), 0, 0, &limit);
    assert!(
        b.plan(100_000, 0, &limit, true, FOREVER).is_none(),
        "tokens still reserved"
    );
    assert_eq!(b.take_leased(1), Hit::Short);
    // The tranche comes and is used up: the next reservation is asked for at once, before
    // the next token is due (without reservations, nothing would be asked until then).
    b.known_short(1, 300_000, &limit, FOREVER);
    for _ in 0..3 {
        assert_ne!(b.take_leased(1), Hit::Short);
    }
    assert!(b.plan(300_000, 0, &limit, false, FOREVER).is_none());
    assert!(b.plan(300_000, 0, &limit, true, FOREVER).is_some());
}

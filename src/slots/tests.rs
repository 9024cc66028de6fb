use super::*;
use crate::clock::exactly;

type Lease = SlotLease<&'static str>;

fn seq(n: u64) -> impl FnOnce() -> u64 {
    move || n
}

/// A lease holding `granted` slots until 1,000 (asked for at time 0 by as many requests, all
/// but the first of which have ended), so one request is in flight.
fn holding(granted: u64) -> Lease {
    const NAMES: [&str; 4] = ["w0", "w1", "w2", "w3"];
    let mut lease = Lease::new(0, 0, false);
    for name in &NAMES[..granted as usize] {
        lease.wait(name, 0, seq(1));
    }
    let decided = lease.answered(1, granted, 1_000, 0, seq(2));
    assert_eq!(decided.admitted, NAMES[..granted as usize]);
    for _ in 1..granted {
        lease.release(|| 0);
    }
    lease
}

#[test]
fn a_cold_key_waits_for_the_store_and_asks_for_what_waits() {
    let mut lease = Lease::new(0, 0, false);
    assert_eq!(lease.try_take(&mut exactly(0)), TryTake::MustWait);
    let call = lease.wait("a", 0, seq(7));
    assert_eq!(
        call,
        Some(SlotCall {
            seq: 7,
            want: 1,
            sent_at: 0
        })
    );
    // A second request while the call is out waits for it without a call of its own.
    assert_eq!(lease.try_take(&mut exactly(1)), TryTake::MustWait);
    assert_eq!(lease.wait("b", 1, seq(8)), None);
    let decided = lease.answered(7, 1, 1_000, 2, seq(9));
    assert_eq!(decided.admitted, ["a"]);
    assert!(decided.full.is_empty());
    // "b" came after the call was sent: the answer says nothing about it, so it is asked for.
    assert_eq!(
        decided.next,
        Some(SlotCall {
            seq: 9,
            want: 2,
            sent_at: 2
        })
    );
    let decided = lease.answered(9, 1, 1_000, 3, seq(10));
    assert_eq!(
        decided.full,
        ["b"],
        "asked after it came, the fleet was full"
    );
    assert_eq!((lease.in_use(), lease.held()), (1, 1));
}

#[test]
fn free_slots_are_taken_without_a_call_until_the_holding_ends() {
    let mut lease = holding(3);
    assert_eq!(lease.try_take(&mut exactly(10)), TryTake::Taken);
    assert_eq!(lease.try_take(&mut exactly(10)), TryTake::Taken);
    assert_eq!(
        lease.try_take(&mut exactly(10)),
        TryTake::MustWait,
        "three of three in use"
    );
    assert_eq!(lease.release(|| 11), None);
    assert_eq!(lease.try_take(&mut exactly(999)), TryTake::Taken);
    lease.release(|| 999);
    assert_eq!(
        lease.try_take(&mut exactly(1_000)),
        TryTake::MustWait,
        "the holding has ended"
    );
}

#[test]
fn a_released_slot_goes_to_the_first_waiter() {
    let mut lease = holding(1);
    assert_eq!(lease.try_take(&mut exactly(5)), TryTake::MustWait);
    assert!(lease.wait("x", 5, seq(2)).is_some());
    assert_eq!(lease.wait("y", 6, seq(3)), None);
    assert_eq!(lease.release(|| 7), Some("x"));
    assert_eq!(lease.in_use(), 1);
    // Nobody may jump the queue while "y" waits, even on a slot freed for it.
    assert_eq!(lease.release(|| 8), Some("y"));
    assert_eq!(lease.try_take(&mut exactly(8)), TryTake::MustWait);
}

#[test]
fn a_request_that_came_after_a_full_answer_was_asked_is_not_refused_by_it() {
    let mut lease = holding(1);
    assert!(lease.wait("early", 5, seq(2)).is_some());
    assert_eq!(lease.wait("late", 9, seq(3)), None);
    let decided = lease.answered(2, 1, 2_000, 10, seq(4));
    assert_eq!(decided.full, ["early"]);
    assert!(decided.admitted.is_empty());
    assert_eq!(decided.next.map(|c| (c.seq, c.want)), Some((4, 2)));
}

#[test]
fn while_a_give_back_is_out_the_host_uses_the_smaller_holding() {
    let mut lease = holding(3);
    assert_eq!(lease.try_take(&mut exactly(1)), TryTake::Taken);
    assert_eq!(lease.try_take(&mut exactly(1)), TryTake::Taken);
    for _ in 0..3 {
        lease.release(|| 2);
    }
    // Three were in flight in this pass and the one before: the slots linger two passes.
    assert_eq!(lease.sweep(3, 0, seq(2)), None);
    assert_eq!(lease.sweep(4, 0, seq(2)), None);
    let give_back = lease.sweep(5, 0, seq(2));
    assert_eq!(give_back.map(|c| c.want), Some(0));
    assert_eq!(
        lease.try_take(&mut exactly(6)),
        TryTake::MustWait,
        "the store may have applied it"
    );
    // The give-back failed: the host keeps counting on the smaller holding.
    let decided = lease.failed(2, 100);
    assert!(decided.unavailable.is_empty() && decided.admitted.is_empty());
    assert_eq!(lease.held(), 0);
}

#[test]
fn after_a_failed_call_the_holding_is_set_again_once_the_back_off_is_over() {
    // A request's call for a slot times out; the store may have applied it.
    let mut lease = Lease::new(0, 0, false);
    assert!(lease.wait("a", 0, seq(1)).is_some());
    let decided = lease.failed(1, 100);
    assert_eq!(decided.unavailable, ["a"]);
    assert!(!lease.is_idle(), "the store may hold a slot for this host");
    assert_eq!(lease.sweep(50, 0, seq(2)), None, "not during the back-off");
    let reconcile = lease.sweep(100, 0, seq(2));
    assert_eq!(
        reconcile.map(|c| c.want),
        Some(0),
        "nothing is counted on: set to none"
    );
    lease.answered(2, 0, 1_100, 110, seq(3));
    assert!(lease.is_idle());
}

#[test]
fn patient_requests_wait_through_a_full_answer_for_the_sweep_to_ask_again() {
    let mut lease = Lease::new(0, 0, true);
    assert!(lease.wait("a", 0, seq(1)).is_some());
    let decided = lease.answered(1, 0, 1_000, 5, seq(2));
    assert!(
        decided.full.is_empty() && decided.next.is_none(),
        "no refusal, no call at once"
    );
    assert_eq!(lease.waiting(), 1);
    let again = lease.sweep(50, 0, seq(2));
    assert_eq!(again.map(|c| c.want), Some(1));
    let decided = lease.answered(2, 1, 1_050, 55, seq(3));
    assert_eq!(decided.admitted, ["a"]);
    // A waiter whose request ended is forgotten, and asked for no more.
    assert!(lease.wait("gone", 60, seq(3)).is_some());
    lease.answered(3, 1, 1_060, 65, seq(4));
    lease.forget_gone(|w| *w == "gone");
    assert_eq!(lease.waiting(), 0);
    assert_eq!(lease.sweep(70, 0, seq(4)), None);
}

#[test]
fn an_answer_to_an_older_call_changes_nothing() {
    let mut lease = holding(2);
    let decided = lease.answered(1, 50, 9_000, 5, seq(3));
    assert!(decided.admitted.is_empty() && decided.next.is_none());
    assert_eq!(lease.held(), 2);
    assert!(lease.failed(1, 100).unavailable.is_empty());
    assert_eq!(lease.held(), 2);
}

#[test]
fn a_failed_call_decides_its_waiters_by_the_fallback_cap_and_so_do_later_requests() {
    let mut lease = Lease::new(2, 0, false);
    assert!(lease.wait("a", 0, seq(1)).is_some());
    lease.wait("b", 0, seq(2));
    lease.wait("c", 0, seq(3));
    let decided = lease.failed(1, 500);
    assert_eq!(decided.admitted, ["a", "b"]);
    assert_eq!(decided.unavailable, ["c"]);
    assert_eq!(
        lease.try_take(&mut exactly(10)),
        TryTake::Fallback { admitted: false }
    );
    lease.release(|| 11);
    assert_eq!(
        lease.try_take(&mut exactly(12)),
        TryTake::Fallback { admitted: true }
    );
    // After the back-off, a request asks the store again.
    lease.release(|| 13);
    assert_eq!(lease.try_take(&mut exactly(500)), TryTake::MustWait);
}

#[test]
fn the_sweep_renews_what_is_held_or_in_use_and_gives_back_what_stays_unused() {
    let mut lease = holding(2);
    assert_eq!(
        lease.sweep(100, 500, seq(2)),
        None,
        "one in flight of 2 held, ends after 500"
    );
    let renewal = lease.sweep(600, 1_100, seq(2));
    assert_eq!(
        renewal.map(|c| c.want),
        Some(2),
        "one unused pass is not enough to give back"
    );
    assert_eq!(
        lease.sweep(600, 1_100, seq(3)),
        None,
        "one call out at a time"
    );
    lease.answered(2, 2, 1_600, 610, seq(3));
    // Two passes with at most one in flight: the unused slot goes back, the one in use stays.
    let give_back = lease.sweep(700, 0, seq(3));
    assert_eq!(give_back.map(|c| c.want), Some(1));
    lease.answered(3, 1, 1_700, 710, seq(4));
    lease.release(|| 720);
    assert_eq!(lease.sweep(800, 0, seq(4)), None, "in flight in this pass");
    assert_eq!(
        lease.sweep(900, 0, seq(4)),
        None,
        "in flight in the pass before"
    );
    let give_back = lease.sweep(1_000, 0, seq(4));
    assert_eq!(give_back.map(|c| c.want), Some(0));
    lease.answered(4, 0, 1_900, 910, seq(5));
    assert!(lease.is_idle());
}

#[test]
fn a_key_in_steady_use_gives_back_what_it_no_longer_needs() {
    // Four held; requests come and go all the time, never more than one at once.
    let mut lease = holding(4);
    lease.release(|| 1);
    for pass in 0..3u64 {
        assert_eq!(lease.try_take(&mut exactly(10 + pass)), TryTake::Taken);
        lease.release(|| 11 + pass);
        if let Some(call) = lease.sweep(12 + pass, 0, seq(2 + pass)) {
            assert_eq!(call.want, 1, "pass {pass}");
            return;
        }
    }
    panic!("the unused slots were never given back");
}

#[test]
fn requests_running_past_their_holding_are_renewed_and_block_new_ones_until_confirmed() {
    let mut lease = holding(1);
    // The holding ran out (the store was unreachable) with one request still running.
    assert_eq!(lease.try_take(&mut exactly(1_500)), TryTake::MustWait);
    let renewal = lease.sweep(1_500, 2_000, seq(2));
    assert_eq!(renewal.map(|c| c.want), Some(1));
    // Meanwhile another host took the slot: the store confirms none.
    lease.answered(2, 0, 2_500, 1_510, seq(3));
    lease.release(|| 1_600);
    assert_eq!(lease.in_use(), 0);
    assert_eq!(lease.try_take(&mut exactly(1_700)), TryTake::MustWait);
}

/// A seeded stream of draws, each below the bound asked (xorshift).
pub(crate) fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = seed;
    move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    }
}

/// The time `now` as a recent reading trailing it by some of `lag` tells it.
fn lagging(now: u64, lag: u64, next: &mut impl FnMut(u64) -> u64) -> Now<impl FnMut() -> u64> {
    Now::new(now.saturating_sub(next(lag + 1)), lag, move || now)
}

#[test]
fn a_recent_reading_within_its_lag_of_the_holdings_end_does_not_admit_past_it() {
    let mut lease = holding(2);
    // The reading says 990, but it trails by up to 50: the time is read, and it is 1,000.
    assert_eq!(
        lease.try_take(&mut Now::new(990, 50, || 1_000)),
        TryTake::MustWait
    );
    assert_eq!(
        lease.try_take(&mut Now::new(990, 50, || 999)),
        TryTake::Taken
    );
}

#[test]
fn no_admission_on_the_store_goes_past_the_usable_holding_over_random_steps() {
    // A seeded walk over every operation: a request admitted on the store's holding (not by
    // the failure policy) leaves at most the smaller of what the store confirmed and what a
    // call out asks in use, and only while the holding is current, though the time it is
    // asked at is a recent reading that trails the time.
    let mut next = draws(0x9E37_79B9_7F4A_7C15_u64);
    let mut admissions = 0;
    for _ in 0..300 {
        let credit = next(3);
        let mut lease = SlotLease::<u64>::new(next(3), credit, next(2) == 0);
        let mut now = 0;
        let mut seq_no = 0;
        let mut running = 0u64;
        let mut waiting = Vec::new();
        for step in 0..200u64 {
            now += next(50);
            match next(6) {
                0 => match lease.try_take(&mut lagging(now, next(100), &mut next)) {
                    TryTake::Taken => {
                        running += 1;
                        admissions += 1;
                        assert!(lease.in_use() <= lease.usable(now), "step {step}");
                    }
                    TryTake::Fallback { admitted } => running += u64::from(admitted),
                    TryTake::OnCredit => {
                        running += 1;
                        seq_no += 1;
                        lease.ask(now, || seq_no);
                        let beyond = lease.in_use().saturating_sub(lease.usable(now));
                        assert!(beyond <= credit, "step {step}: {beyond} beyond the holding");
                    }
                    TryTake::MustWait => {
                        seq_no += 1;
                        lease.wait(step, now, || seq_no);
                        waiting.push(step);
                    }
                },
                1 if running > 0 => match lease.release(|| now) {
                    Some(w) => {
                        waiting.retain(|x| *x != w);
                        assert!(lease.in_use() <= lease.usable(now), "step {step}");
                    }
                    None => running -= 1,
                },
                2 | 3 => {
                    if let Some(call) = lease.call {
                        let (decided, on_store) = if next(4) == 0 {
                            (lease.failed(call.seq, now + next(200)), false)
                        } else {
                            let granted = call.want.min(next(6));
                            seq_no += 1;
                            let until = now + next(400);
                            (
                                lease.answered(call.seq, granted, until, now, || seq_no),
                                true,
                            )
                        };
                        running += decided.admitted.len() as u64;
                        if on_store && !decided.admitted.is_empty() {
                            admissions += decided.admitted.len();
                            assert!(lease.in_use() <= lease.usable(now), "step {step}");
                        }
                        let ended = decided.admitted.iter().chain(&decided.full);
                        for w in ended.chain(&decided.unavailable) {
                            waiting.retain(|x| x != w);
                        }
                    }
                }
                4 => {
                    seq_no += 1;
                    lease.sweep(now, now + 100, || seq_no);
                }
                _ => lease.note_others(next(3), next(3), 3),
            }
            assert_eq!(lease.in_use(), running, "step {step}");
            assert_eq!(lease.waiting(), waiting.len(), "step {step}");
        }
    }
    assert!(
        admissions > 1_000,
        "the walk admits on the store: {admissions}"
    );
}

#[test]
fn free_slots_are_what_the_others_and_this_hosts_requests_leave() {
    // Two in flight here, of a limit of 5, the others holding 2 at the last answer.
    let mut lease = holding(2);
    lease.try_take(&mut exactly(10));
    lease.note_others(2, 2, 5);
    assert_eq!(lease.in_use(), 2);
    assert_eq!(lease.free(5, || 10), 1);
    // The others took more than the limit leaves (it was lowered): none free, not a wrap.
    lease.note_others(4, 2, 5);
    assert_eq!(lease.free(5, || 10), 0);
    // While the store fails, the failure policy's share counts, whatever the others held.
    let mut failing = Lease::new(3, 0, false);
    failing.wait("a", 0, seq(1));
    let decided = failing.failed(1, 500);
    assert_eq!(decided.admitted, ["a"]);
    assert_eq!(failing.free(5, || 100), 2, "a share of 3, one in flight");
    assert_eq!(failing.free(2, || 100), 1, "never more than the limit");
    assert_eq!(
        failing.free(5, || 500),
        4,
        "the store is asked again: the limit counts"
    );
}

#[test]
fn a_key_not_known_full_is_admitted_on_credit_and_the_store_asked_to_hold_it() {
    let mut lease = Lease::new(0, 2, false);
    // A cold key: two requests at once on credit, one call out for the first.
    assert_eq!(lease.try_take(&mut exactly(0)), TryTake::OnCredit);
    let call = lease
        .ask(0, seq(1))
        .expect("a call for the credited request");
    assert_eq!((call.seq, call.want), (1, 1));
    assert_eq!(lease.try_take(&mut exactly(1)), TryTake::OnCredit);
    assert_eq!(lease.ask(1, seq(2)), None, "one call out at a time");
    // The credit is spent: the third waits.
    assert_eq!(lease.try_take(&mut exactly(2)), TryTake::MustWait);
    assert_eq!(lease.in_use(), 2);
    // The store held what it was asked, one: the second request is still beyond the
    // holding, so the store is asked to hold both.
    let decided = lease.answered(1, 1, 1_000, 3, seq(3));
    assert!(decided.admitted.is_empty() && decided.full.is_empty());
    let next = decided
        .next
        .expect("a call for what runs beyond the holding");
    assert_eq!((next.seq, next.want), (3, 2));
}

#[test]
fn credit_counts_what_runs_beyond_the_holding() {
    // One slot held and in use; one request of credit.
    let mut lease = holding(1);
    lease.set_caps(0, 1);
    assert_eq!(lease.try_take(&mut exactly(10)), TryTake::OnCredit);
    assert_eq!(lease.try_take(&mut exactly(10)), TryTake::MustWait);
    // Once the holding expires, it covers nothing: the two in flight are beyond it, which
    // is more than the credit.
    lease.release(|| 1_000);
    assert_eq!(lease.try_take(&mut exactly(1_000)), TryTake::MustWait);
}

#[test]
fn a_key_known_full_gets_no_credit_and_a_full_answer_is_not_asked_again() {
    let mut lease = Lease::new(0, 1, false);
    assert_eq!(lease.try_take(&mut exactly(0)), TryTake::OnCredit);
    let call = lease.ask(0, seq(1)).expect("a call");
    // The fleet was full: the store held nothing for this host. The request runs on (it is
    // the credit's overshoot) and the store is not asked again in a loop.
    let decided = lease.answered(call.seq, 0, 1_000, 5, seq(2));
    assert!(decided.next.is_none());
    lease.note_others(3, 0, 3);
    assert_eq!(lease.try_take(&mut exactly(6)), TryTake::MustWait);
    // An answer that leaves a slot free gives credit again.
    lease.note_others(1, 0, 3);
    lease.forget_gone(|_| true);
    lease.release(|| 7);
    assert_eq!(lease.try_take(&mut exactly(8)), TryTake::OnCredit);
}

#[test]
fn credit_never_runs_past_the_slots_the_last_answer_left_this_host() {
    // A credit of 5, but the others held 8 of 10 at the last answer, this host none: two may
    // run on credit, not five.
    let mut lease = Lease::new(0, 5, false);
    assert_eq!(lease.try_take(&mut exactly(0)), TryTake::OnCredit);
    let call = lease.ask(0, seq(1)).expect("a call");
    lease.note_others(8, 1, 10);
    lease.answered(call.seq, 1, 1_000, 5, seq(2));
    assert_eq!(lease.try_take(&mut exactly(6)), TryTake::OnCredit);
    assert_eq!(lease.try_take(&mut exactly(6)), TryTake::MustWait);
    assert_eq!(lease.in_use(), 2);
    // Before any answer, the credit alone bounds it.
    let mut fresh = Lease::new(0, 3, false);
    for _ in 0..3 {
        assert_eq!(fresh.try_take(&mut exactly(0)), TryTake::OnCredit);
    }
    assert_eq!(fresh.try_take(&mut exactly(0)), TryTake::MustWait);
}

#[test]
fn no_credit_while_an_earlier_request_waits_or_the_store_fails() {
    let mut lease = Lease::new(0, 1, false);
    assert_eq!(lease.try_take(&mut exactly(0)), TryTake::OnCredit);
    let call = lease.ask(0, seq(1)).expect("a call");
    assert_eq!(lease.try_take(&mut exactly(1)), TryTake::MustWait);
    assert_eq!(lease.wait("w", 1, seq(2)), None, "the call out serves it");
    // The credited request ends: the credit is free again, but the waiter came first.
    assert_eq!(lease.release(|| 2), None);
    assert_eq!(lease.try_take(&mut exactly(3)), TryTake::MustWait);
    // The call fails: the failure policy (a share of nothing) decides, not the credit.
    let decided = lease.failed(call.seq, 500);
    assert_eq!(decided.unavailable, ["w"]);
    assert_eq!(
        lease.try_take(&mut exactly(4)),
        TryTake::Fallback { admitted: false }
    );
}

#[test]
fn a_stopping_host_gives_back_all_but_its_slots_in_use() {
    // Three held, one in flight: the call keeps one.
    let mut lease = holding(3);
    let call = lease.give_back_unused(5, seq(20));
    assert_eq!(
        call,
        Some(SlotCall {
            seq: 20,
            want: 1,
            sent_at: 5
        })
    );
    // Nothing more while it is out.
    assert_eq!(lease.give_back_unused(6, seq(21)), None);
    lease.answered(20, 1, 1_000, 7, seq(22));
    assert_eq!((lease.in_use(), lease.held()), (1, 1));
    // Nothing beyond what is in use: no call.
    assert_eq!(lease.give_back_unused(8, seq(23)), None);
    // The last request ends: everything goes.
    lease.release(|| 9);
    assert_eq!(lease.give_back_unused(9, seq(24)).map(|c| c.want), Some(0));
}

#[test]
fn past_a_lowered_limit_the_host_admits_only_the_room_left_and_its_holding_runs_down() {
    // Three in flight on a holding of 3 of 5; the limit is lowered to 2, another host holds
    // none. The store keeps the 3 (it takes only what a host gives back): the renewal's
    // answer leaves room for 2.
    let mut lease = Lease::new(0, 0, false);
    for name in ["a", "b", "c"] {
        lease.wait(name, 0, seq(1));
    }
    lease.note_others(0, 3, 5);
    assert_eq!(lease.answered(1, 3, 1_000, 0, seq(2)).admitted.len(), 3);
    let renewal = lease.sweep(900, 1_100, seq(3)).expect("a renewal");
    lease.note_others(0, 3, 2);
    let decided = lease.answered(renewal.seq, 3, 2_000, 905, seq(4));
    assert_eq!(decided.next, None, "asked for what it holds, and got it");
    // One ends: two still run, the room the answer left; the next must ask. The third slot,
    // which could admit nothing, is not asked for again: the store takes it back.
    assert_eq!(lease.release(|| 910), None);
    assert_eq!(lease.try_take(&mut exactly(910)), TryTake::MustWait);
    let call = lease.wait("d", 910, seq(5)).expect("a call");
    assert_eq!(call.want, 2);
    lease.note_others(0, 2, 2);
    let decided = lease.answered(call.seq, 2, 2_000, 915, seq(6));
    assert_eq!(lease.held(), 2);
    // Asked for it, the store, with room for 2, holds no third: refused as full.
    let call = decided.next.expect("a call for the one waiting");
    assert_eq!(call.want, 3);
    lease.note_others(0, 2, 2);
    let decided = lease.answered(call.seq, 2, 2_000, 920, seq(7));
    assert_eq!(decided.full, ["d"], "the limit leaves 2");
    assert_eq!(decided.next, None);
    // Another ends: one runs, one more may.
    assert_eq!(lease.release(|| 925), None);
    assert_eq!(lease.try_take(&mut exactly(925)), TryTake::Taken);
    assert_eq!(lease.try_take(&mut exactly(925)), TryTake::MustWait);
    assert_eq!(lease.free(2, || 925), 0);
}

#[test]
fn hosts_holding_more_than_a_lowered_limit_leaves_them_give_back_what_admits_nothing() {
    // Two hosts held a slot each in flight when the limit went from 8 to 1: each answer
    // leaves either no room (the other holds 1). Their requests end, and each has one
    // waiting. Asked for their waiters, the store would keep each host's slot, which admits
    // nothing: neither host would ever admit again.
    let mut hosts: Vec<Lease> = (0..2).map(|_| Lease::new(0, 0, false)).collect();
    for (lease, name) in hosts.iter_mut().zip(["a", "b"]) {
        lease.wait(name, 0, seq(1));
        lease.note_others(1, 1, 8);
        assert_eq!(lease.answered(1, 1, 10_000, 0, seq(2)).admitted, [name]);
        lease.note_others(1, 1, 1);
        assert_eq!(lease.release(|| 10), None);
    }
    for (lease, name) in hosts.iter_mut().zip(["c", "d"]) {
        assert_eq!(lease.try_take(&mut exactly(20)), TryTake::MustWait);
        let call = lease.wait(name, 20, seq(3)).expect("a call");
        assert_eq!(
            call.want, 0,
            "{name}'s host gives back the slot it cannot use"
        );
    }
    // The first host's call lands first: it holds none, and the other still holds its 1.
    hosts[0].note_others(1, 0, 1);
    let decided = hosts[0].answered(3, 0, 10_000, 25, seq(4));
    assert!(decided.admitted.is_empty());
    let again = decided.next.expect("it asks again for its waiter");
    assert_eq!(again.want, 1);
    // The second host's lands next: the first holds none now; it asks for its waiter.
    hosts[1].note_others(0, 0, 1);
    let decided = hosts[1].answered(3, 0, 10_000, 26, seq(4));
    let call = decided.next.expect("a call for its waiter");
    assert_eq!(call.want, 1);
    hosts[1].note_others(0, 1, 1);
    assert_eq!(
        hosts[1].answered(call.seq, 1, 10_000, 27, seq(5)).admitted,
        ["d"]
    );
    // The first's second call finds the slot taken: refused as full, exactly.
    hosts[0].note_others(1, 0, 1);
    assert_eq!(
        hosts[0].answered(again.seq, 0, 10_000, 28, seq(5)).full,
        ["c"]
    );
}

//! A fleet of hosts' slot leases ([`SlotLease`]) on one store that follows the slot stores'
//! rule ([`Holding::granted`]), walked at random: the lease's state machine and the store's
//! rule together hold the fleet's bound.

use std::collections::HashMap;

use crate::clock::exactly;
use crate::global::slots::Holding;
use crate::slots::tests::draws;
use crate::slots::{SlotCall, SlotLease, TryTake};

/// The slot store's rule ([`Holding::granted`]) for a fleet of hosts, each with its holding
/// and the sequence number of the last call applied for it (holdings never expire here).
struct FleetStore {
    held: Vec<u64>,
    applied: Vec<u64>,
}

impl FleetStore {
    /// Applies host `host`'s call under the limit it was sent with: the holding and what the
    /// others hold.
    fn apply(&mut self, host: usize, call: SlotCall, max: u64) -> (u64, u64) {
        let others = self.held.iter().sum::<u64>() - self.held[host];
        if call.seq > self.applied[host] {
            let mine = self.held[host];
            self.held[host] = Holding::granted(max, others, mine, call.want).held;
            self.applied[host] = call.seq;
        }
        (self.held[host], others)
    }
}

#[test]
fn a_fleets_requests_stay_within_the_stores_holdings_through_late_calls_and_limit_changes() {
    // A seeded walk over hosts sharing one store: calls answered, failed (the store applying
    // some of them later, under the limit they were sent with), holdings swept and given back,
    // and in half the walks the limit changed. Whatever the order, every request in flight on
    // a host is covered by what the store holds for that host; so the fleet never has more in
    // flight than the largest limit applied, and no more than the limit once a change has
    // settled (every host answered under it, the requests admitted before it ended).
    let mut next = draws(0x2545_F491_4F6C_DD1D_u64);
    let (mut admissions, mut late_applied, mut cut_off) = (0, 0, 0);
    for walk in 0..400 {
        let hosts = 2 + next(2) as usize;
        let changing = walk % 2 == 1;
        let mut max = 1 + next(5);
        let mut largest = max;
        let mut leases: Vec<SlotLease<u64>> = (0..hosts)
            .map(|_| SlotLease::new(0, 0, next(2) == 0))
            .collect();
        let mut store = FleetStore {
            held: vec![0; hosts],
            applied: vec![0; hosts],
        };
        // The limit each call was sent under, by its host's sequence number.
        let mut sent_under: Vec<HashMap<u64, u64>> = vec![HashMap::new(); hosts];
        let mut late: Vec<(usize, SlotCall)> = Vec::new();
        let (mut seq_no, mut now, mut waiter) = (0u64, 0u64, 0u64);
        // Since the last change: the calls numbered after it, whether each host has had an
        // answer to one, and its requests admitted before that answer that still run.
        let mut changed_after = 0;
        let mut fresh = vec![true; hosts];
        let mut from_before = vec![0u64; hosts];
        for step in 0..300 {
            now += 1 + next(20);
            let h = next(hosts as u64) as usize;
            let before = leases[h].in_use();
            let mut sent = None;
            match next(8) {
                0 | 1 => match leases[h].try_take(&mut exactly(now)) {
                    TryTake::MustWait => {
                        waiter += 1;
                        seq_no += 1;
                        sent = leases[h].wait(waiter, now, || seq_no);
                    }
                    TryTake::Taken | TryTake::Fallback { .. } | TryTake::OnCredit => {}
                },
                2 if before > 0 => {
                    leases[h].release(|| now);
                    from_before[h] = from_before[h].min(before - 1);
                }
                3 | 4 => {
                    if let Some(call) = leases[h].call_out() {
                        if next(4) == 0 {
                            // Lost on its way, or applied later than its host gave up.
                            if next(2) == 0 {
                                late.push((h, call));
                            }
                            leases[h].failed(call.seq, now + next(30));
                        } else {
                            let (held, others) = store.apply(h, call, sent_under[h][&call.seq]);
                            leases[h].note_others(others, held, sent_under[h][&call.seq]);
                            seq_no += 1;
                            let decided =
                                leases[h].answered(call.seq, held, u64::MAX, now, || seq_no);
                            cut_off += decided.full.len();
                            sent = decided.next;
                            fresh[h] |= call.seq > changed_after;
                        }
                    }
                }
                5 if !late.is_empty() => {
                    let (host, call) = late.swap_remove(next(late.len() as u64) as usize);
                    store.apply(host, call, sent_under[host][&call.seq]);
                    late_applied += 1;
                }
                6 if changing => {
                    max = next(6);
                    largest = largest.max(max);
                    changed_after = seq_no;
                    fresh.fill(false);
                }
                _ => {
                    seq_no += 1;
                    sent = leases[h].sweep(now, now + 40, || seq_no);
                }
            }
            if let Some(call) = sent {
                sent_under[h].insert(call.seq, max);
            }
            admissions += leases[h].in_use().saturating_sub(before);
            // A host that has not heard the store under the new limit admits by the old.
            for ((old, lease), fresh) in from_before.iter_mut().zip(&leases).zip(&fresh) {
                if !fresh {
                    *old = lease.in_use();
                }
            }
            for (host, lease) in leases.iter().enumerate() {
                assert!(
                    lease.in_use() <= store.held[host],
                    "walk {walk} step {step}: host {host} runs {} on a holding of {}",
                    lease.in_use(),
                    store.held[host]
                );
            }
            let in_flight: u64 = leases.iter().map(|l| l.in_use()).sum();
            // A changed limit holds once every host has heard the store under it and the
            // requests each admitted before then have ended.
            let settled = fresh.iter().all(|f| *f) && from_before.iter().all(|n| *n == 0);
            let bound = if settled { max } else { largest };
            assert!(
                in_flight <= bound,
                "walk {walk} step {step}: {in_flight} in flight, limit {bound}"
            );
        }
    }
    assert!(admissions > 5_000, "the walks admit: {admissions}");
    assert!(late_applied > 500, "late calls applied: {late_applied}");
    assert!(cut_off > 500, "refusals as full: {cut_off}");
}

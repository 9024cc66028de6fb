//! Concurrency slots: the rules every [`SlotStore`] follows ([`Holding::granted`]).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::StreamExt;

use crate::clock::ManualClock;
use crate::global::slots::{Holding, SlotHold, SlotStore};
use crate::quota::BucketKey;

/// The bucket the suite holds slots of.
const SLOTS_KEY: &str = "slots-conformance";

/// Holdings are absolute (what a host holds now, not an addition), capped by what the other
/// hosts hold but never cut below what the host holds (up to its ask, whatever the limit),
/// never changed by a call older than the host's last applied one, and expire their time to
/// live after they were set; every other call goes through
/// [`hold_many`](SlotStore::hold_many), with the same answers. The store must keep time by
/// `clock`, and hold no slots yet of the key `slots-conformance` (limit name `concurrency`).
pub async fn assert_slot_conformance<S>(store: &S, clock: &ManualClock)
where
    S: SlotStore<BucketKey<String>>,
{
    let key = BucketKey::new(SLOTS_KEY.to_owned(), "concurrency").expect("a valid name");
    let ttl = Duration::from_secs(5);
    let calls = AtomicU32::new(0);
    let ask_under = async |max, host, seq, want| {
        let hold = SlotHold {
            host,
            seq,
            want,
            ttl,
        };
        let answer = match calls.fetch_add(1, Ordering::Relaxed) % 2 {
            0 => store.hold(&key, max, hold).await,
            _ => {
                let mut answers: Vec<_> = store
                    .hold_many(vec![(key.clone(), max, hold)])
                    .collect()
                    .await;
                match answers.pop() {
                    Some((0, answer)) => answer,
                    other => panic!("a batch of one hold answered {other:?}"),
                }
            }
        };
        answer.unwrap_or_else(|error| panic!("hold: {error}"))
    };
    let ask = async |host, seq, want| ask_under(5, host, seq, want).await;
    let holding = |held, others| Holding { held, others };
    assert_eq!(ask(1, 1, 3).await, holding(3, 0));
    assert_eq!(ask(2, 1, 4).await, holding(2, 3), "capped by the others");
    assert_eq!(ask(1, 2, 1).await, holding(1, 2), "absolute, not added");
    assert_eq!(ask(1, 2, 5).await, holding(1, 2), "a repeated call");
    assert_eq!(ask(1, 1, 5).await, holding(1, 2), "an older call");
    assert_eq!(ask(2, 3, 4).await, holding(4, 1));
    clock.advance(Duration::from_secs(4));
    assert_eq!(ask(3, 1, 5).await, holding(0, 5), "the fleet is full");
    clock.advance(Duration::from_secs(1));
    // Host 1's holding and host 2's were both set 5 s ago: expired.
    assert_eq!(ask(3, 2, 5).await, holding(5, 0), "expired holdings");
    assert_eq!(ask(3, 3, 0).await, holding(0, 0), "given back");
    assert_eq!(
        ask(1, 1, 2).await,
        holding(2, 0),
        "a new holding starts over"
    );
    assert_eq!(ask(2, 4, 3).await, holding(3, 2), "the limit of 5 is full");
    // A call with a lower limit (lowered since, or sent before it was raised and applied
    // late) keeps what the host holds up to its ask: a host gives back only by asking less.
    assert_eq!(
        ask_under(3, 1, 2, 4).await,
        holding(2, 3),
        "a lower limit takes nothing"
    );
    assert_eq!(
        ask_under(3, 2, 5, 2).await,
        holding(2, 2),
        "given back by asking less"
    );
    assert_eq!(
        ask_under(3, 2, 6, 3).await,
        holding(2, 2),
        "grows only within the limit"
    );
}

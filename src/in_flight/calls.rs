//! The slot store's calls: one task per key with a call out, which delivers each answer to
//! the requests waiting for it and makes the next call the answer calls for. The calls of all
//! keys go to the store in batches ([`batch`](super::batch)).

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::clock::{Clock, micros};
use crate::global::slots::{SlotHold, SlotStore};
use crate::in_flight::{Entry, Shared, Verdict};
use crate::quota::BucketKey;
use crate::slots::{Decided, SlotCall};

/// Makes `call` for `key` on a task of its own.
pub(super) fn spawn<K, S, C>(
    shared: Arc<Shared<K, S, C>>,
    key: K,
    entry: Arc<Entry>,
    call: SlotCall,
) where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    shared.calls_under_way.started();
    let guard = CallGuard {
        shared,
        entry,
        seq: Some(call.seq),
    };
    // Outside a Tokio runtime there is nothing to make the call on: dropped unrun, the guard
    // settles it as failed, and the failure policy decides.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(run(guard, key, call));
    }
}

/// Settles the call out as failed if its task ends before its answer (cancelled, panicking,
/// its runtime shut down), so no request waits for an answer that never comes.
struct CallGuard<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    shared: Arc<Shared<K, S, C>>,
    entry: Arc<Entry>,
    seq: Option<u64>,
}

impl<K, S, C> Drop for CallGuard<K, S, C>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    fn drop(&mut self) {
        self.shared.calls_under_way.ended();
        if let Some(seq) = self.seq.take() {
            let retry_at =
                (self.shared.now()).saturating_add(micros(self.shared.settings.back_off));
            let decided = self.entry.lease.lock().failed(seq, retry_at);
            deliver(&self.entry, decided);
        }
    }
}

async fn run<K, S, C>(mut guard: CallGuard<K, S, C>, key: K, mut call: SlotCall)
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
{
    let shared = guard.shared.clone();
    let bucket = shared.bucket_key(key);
    loop {
        let hold = SlotHold {
            host: shared.settings.host,
            seq: call.seq,
            want: call.want,
            ttl: shared.settings.slot_ttl,
        };
        shared.counters.store_calls.fetch_add(1, Ordering::Relaxed);
        let max = (shared.max)(bucket.key());
        // The failure policy's share and the credit follow the limit as it is now.
        let (cap, credit) = (shared.settings.fallback.cap(max), shared.credit(max));
        let timeout = shared.settings.store_timeout;
        let answer = tokio::time::timeout(timeout, shared.hold(bucket.clone(), max, hold)).await;
        let now = shared.now();
        let mut lease = guard.entry.lease.lock();
        lease.set_caps(cap, credit);
        let decided = match answer {
            Ok(Some(holding)) => {
                let until = shared.usable_until(call.sent_at);
                let next_seq = || shared.next_seq();
                lease.note_others(holding.others, holding.held, max);
                lease.answered(call.seq, holding.held, until, now, next_seq)
            }
            Ok(None) | Err(_) => {
                shared
                    .counters
                    .store_failures
                    .fetch_add(1, Ordering::Relaxed);
                let retry_at = now.saturating_add(micros(shared.settings.back_off));
                lease.failed(call.seq, retry_at)
            }
        };
        drop(lease);
        let next = decided.next;
        guard.seq = next.map(|next| next.seq);
        deliver(&guard.entry, decided);
        match next {
            Some(next) => call = next,
            None => return,
        }
    }
}

/// Tells each request its verdict; a slot whose request has gone goes to the next waiting or
/// back to the lease.
fn deliver(entry: &Entry, decided: Decided<super::Waiter>) {
    for waiter in decided.admitted {
        entry.hand_over(waiter);
    }
    // Counted by each request as it hears its verdict: one gone meanwhile was not refused.
    for waiter in decided.full {
        let _gone = waiter.send(Verdict::Full);
    }
    for waiter in decided.unavailable {
        let _gone = waiter.send(Verdict::Unavailable);
    }
}

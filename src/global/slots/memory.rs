//! The in-process slot table of [`MemoryGlobalStore`](crate::MemoryGlobalStore).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock::micros;
use crate::global::slots::{Holding, SlotHold};
use crate::sync::lock;

/// Every this many calls, the table forgets every expired holding (calls on a key forget its
/// own), so keys no host holds any more cost no memory for long.
const PRUNE_EVERY: u64 = 1024;

/// What each host holds of each key's slots.
#[derive(Debug)]
pub(crate) struct SlotTable<K> {
    keys: Mutex<HashMap<K, Vec<HostHolding>>>,
    calls: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct HostHolding {
    host: u64,
    held: u64,
    seq: u64,
    /// Store microseconds.
    expires_at: u64,
}

impl<K> Default for SlotTable<K> {
    fn default() -> Self {
        Self {
            keys: Mutex::new(HashMap::new()),
            calls: AtomicU64::new(0),
        }
    }
}

impl<K: Hash + Eq + Clone> SlotTable<K> {
    /// Applies `hold` to `key` at store time `now` (microseconds).
    pub(crate) fn hold(&self, key: &K, max: u64, hold: SlotHold, now: u64) -> Holding {
        let mut keys = lock(&self.keys);
        if self.calls.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == PRUNE_EVERY - 1 {
            keys.retain(|_, hosts| {
                hosts.retain(|h| h.expires_at > now);
                !hosts.is_empty()
            });
        }
        let hosts = keys.entry(key.clone()).or_default();
        hosts.retain(|h| h.expires_at > now);
        let others = hosts
            .iter()
            .filter(|h| h.host != hold.host)
            .map(|h| h.held)
            .sum();
        let mine = hosts.iter_mut().find(|h| h.host == hold.host);
        match mine {
            Some(mine) if hold.seq <= mine.seq => Holding {
                held: mine.held,
                others,
            },
            Some(mine) => {
                let answer = Holding::granted(max, others, mine.held, hold.want);
                *mine = holding(hold, answer.held, now);
                answer
            }
            None => {
                let answer = Holding::granted(max, others, 0, hold.want);
                // Kept even when empty, for its `seq`: a late call must not apply after it.
                hosts.push(holding(hold, answer.held, now));
                answer
            }
        }
    }

    /// Keys with an unexpired holding at store time `now`.
    pub(crate) fn keys_held(&self, now: u64) -> usize {
        lock(&self.keys)
            .values()
            .filter(|hosts| hosts.iter().any(|h| h.expires_at > now && h.held > 0))
            .count()
    }
}

fn holding(hold: SlotHold, held: u64, now: u64) -> HostHolding {
    HostHolding {
        host: hold.host,
        held,
        seq: hold.seq,
        expires_at: now.saturating_add(micros(hold.ttl).max(1)),
    }
}

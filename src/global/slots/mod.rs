//! Slot stores: how many requests each host may have in flight for a key, fleet-wide.
//!
//! A [`SlotStore`] keeps, per key, what each host holds of the key's concurrency limit, each
//! holding with an expiry, so that the slots of a host that dies come back when its holding
//! expires. Hosts set their holding to an absolute number ([`SlotHold::want`]) with a
//! sequence number, never add to it, so a call that is lost, late or repeated can only leave
//! the store holding more for a host than it uses, never less.
//!
//! [`MemoryGlobalStore`](crate::MemoryGlobalStore) is one (in one process), and with the
//! `redis` feature `RedisGlobalStore` (a fleet): the same store a layer's token buckets use.

use std::future::Future;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, Stream};

mod memory;
#[cfg(test)]
mod walk;

pub(crate) use memory::SlotTable;

/// A host's call to set its holding of a key's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotHold {
    /// The host, unique in the fleet (each layer draws one at random when it is built).
    pub host: u64,
    /// Orders the host's calls: a call whose `seq` is not above the last one applied for this
    /// host and key is not applied.
    pub seq: u64,
    /// The holding asked for: the host's whole holding, not an addition to it.
    pub want: u64,
    /// How long the holding lasts unless set again, by the store's clock.
    pub ttl: Duration,
}

/// What a [`SlotStore`] holds for the calling host after a [`SlotHold`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// The host's holding now: `want`, or fewer when the other hosts hold the rest.
    pub held: u64,
    /// What the other hosts hold (their unexpired holdings).
    pub others: u64,
}

impl Holding {
    /// The holding that a call asking for `want` gets when the calling host holds `mine` and
    /// the other hosts hold `others` of `max` slots: what it asks for as far as the others
    /// leave room, and never less than it holds now up to `want`. A limit only bounds how far
    /// a holding grows: a call takes from a host only what it gives back itself, so a call
    /// applied late with a limit since raised (or a lowered limit) never leaves the store
    /// holding less than the host's requests in flight; each host stops admitting past a
    /// lowered limit and gives back as its requests end.
    pub fn granted(max: u64, others: u64, mine: u64, want: u64) -> Self {
        Self {
            held: want.min(mine.max(max.saturating_sub(others))),
            others,
        }
    }
}

/// Where each host's share of a key's concurrency slots is kept, fleet-wide.
///
/// Every store must follow [`Holding::granted`]: the host gets what it asks for as far as the
/// other hosts' unexpired holdings leave room under `max`, and keeps what it holds up to what
/// it asks for (a call never takes more than it gives back); a call whose `seq` is not above the
/// host's last applied one (while that holding lasts) changes nothing and answers the holding
/// as it is. A holding expires `ttl` after the call that set it, by the store's clock.
pub trait SlotStore<K>: Send + Sync + 'static {
    /// Why a call failed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Sets what `hold.host` holds of `key`'s `max` slots.
    fn hold(
        &self,
        key: &K,
        max: u64,
        hold: SlotHold,
    ) -> impl Future<Output = Result<Holding, Self::Error>> + Send;

    /// Sets several holdings, of any keys, in one go, each answered with its index in `holds`
    /// as its answer comes: on Redis, one script per node for all of them, so that a node
    /// that stalls delays only its own keys. By default, each [`hold`](Self::hold) side by
    /// side, so a store that implements only `hold` keeps working.
    fn hold_many(
        &self,
        holds: Vec<(K, u64, SlotHold)>,
    ) -> impl Stream<Item = (usize, Result<Holding, Self::Error>)> + Send
    where
        K: Send + Sync,
    {
        holds
            .into_iter()
            .enumerate()
            .map(|(i, (key, max, hold))| async move { (i, self.hold(&key, max, hold).await) })
            .collect::<FuturesUnordered<_>>()
    }
}

//! A global store in memory (on tokio's clock) that holds some calls back, so that a host's
//! calls reach it in another order than they were sent, or a batch comes late.

use std::convert::Infallible;
use std::time::Duration;

use hierarchical_throttle::clock::TokioClock;
use hierarchical_throttle::global::{
    Adjusted, Adjustment, BucketLevel, GlobalStore, Grant, TokenRequest, TokenReturn,
};
use hierarchical_throttle::quota::BucketKey;
use hierarchical_throttle::{Limit, MemoryGlobalStore};
use tokio::sync::watch;

/// Applies a hand-back `release_delay` after it is sent; fetches for the limit named
/// `gated_limit` wait until the gate opens; everything else at once.
#[derive(Clone)]
pub struct HeldBack {
    inner: MemoryGlobalStore<String, TokioClock>,
    release_delay: Duration,
    gate: Option<(&'static str, watch::Receiver<bool>)>,
}

impl HeldBack {
    /// Hand-backs applied `delay` late.
    pub fn releases_late(delay: Duration) -> Self {
        Self {
            inner: MemoryGlobalStore::with_clock(TokioClock::new()),
            release_delay: delay,
            gate: None,
        }
    }

    /// Fetches for `limit` held until the returned gate is sent `true`.
    pub fn gated(limit: &'static str) -> (Self, watch::Sender<bool>) {
        let (gate, open) = watch::channel(false);
        let store = Self {
            inner: MemoryGlobalStore::with_clock(TokioClock::new()),
            release_delay: Duration::ZERO,
            gate: Some((limit, open)),
        };
        (store, gate)
    }
}

impl GlobalStore<BucketKey<String>> for HeldBack {
    type Error = Infallible;

    async fn acquire(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
        request: TokenRequest,
    ) -> Result<Grant, Infallible> {
        if let Some((gated, open)) = &self.gate
            && key.limit() == *gated
        {
            let _ = open.clone().wait_for(|open| *open).await;
        }
        self.inner.acquire(key, limit, request).await
    }

    async fn release(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
        back: TokenReturn,
    ) -> Result<(), Infallible> {
        tokio::time::sleep(self.release_delay).await;
        self.inner.release(key, limit, back).await
    }

    fn level(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
    ) -> impl Future<Output = Result<BucketLevel, Infallible>> + Send {
        self.inner.level(key, limit)
    }

    fn adjust(
        &self,
        key: &BucketKey<String>,
        limit: &Limit,
        adjustment: Adjustment,
        expires: Option<Duration>,
    ) -> impl Future<Output = Result<Adjusted, Infallible>> + Send {
        self.inner.adjust(key, limit, adjustment, expires)
    }
}

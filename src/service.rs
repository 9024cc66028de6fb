//! The throttling service.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use tower_service::Service;

use crate::admission::AllOf;
use crate::clock::{Clock, MonotonicClock};
use crate::future::ResponseFuture;
use crate::global::GlobalStore;
use crate::key::MissingKey;
use crate::layer::RequestPolicy;
use crate::local::LocalStore;
use crate::local::memory::MemoryLocalStore;
use crate::quota::{BucketKey, LeaseKey};
use crate::response::{DefaultRejection, OnRejection, Rejection, RejectionReason};
use crate::stats::ThrottleStats;
use crate::throttle::{Check, Throttle};

/// Throttles requests to the inner service per key; made by
/// [`HierarchicalThrottleLayer`](crate::HierarchicalThrottleLayer).
///
/// Clones share the layer's buckets and counters.
pub struct HierarchicalThrottle<
    S,
    Req,
    K,
    G,
    L = MemoryLocalStore<K>,
    C = MonotonicClock,
    R = DefaultRejection,
> {
    inner: S,
    throttle: Arc<Throttle<K, G, L, C>>,
    policy: Arc<RequestPolicy<Req, K, R>>,
}

impl<S, Req, K, G, L, C, R> HierarchicalThrottle<S, Req, K, G, L, C, R> {
    pub(crate) fn from_parts(
        inner: S,
        throttle: Arc<Throttle<K, G, L, C>>,
        policy: Arc<RequestPolicy<Req, K, R>>,
    ) -> Self {
        Self {
            inner,
            throttle,
            policy,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the throttle, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, Req, K, G, L, C, R> Clone for HierarchicalThrottle<S, Req, K, G, L, C, R> {
    fn clone(&self) -> Self {
        Self::from_parts(
            self.inner.clone(),
            self.throttle.clone(),
            self.policy.clone(),
        )
    }
}

impl<S: fmt::Debug, Req, K, G, L, C, R> fmt::Debug for HierarchicalThrottle<S, Req, K, G, L, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HierarchicalThrottle")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, Req, K, G, L, C, R> Service<Req> for HierarchicalThrottle<S, Req, K, G, L, C, R>
where
    S: Service<Req> + Clone,
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
    R: OnRejection<Req, K, S::Response, S::Error>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S, Req, K, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    #[inline(always)]
    fn call(&mut self, request: Req) -> Self::Future {
        let cost = self.policy.cost(&request);
        let check = match (self.policy.key)(&request) {
            Some(key) if self.policy.levels.is_empty() => self.throttle.check_key(key, cost),
            key => self.check_levels(key, &request, cost),
        };
        match check {
            Check::Admit => ResponseFuture::called(self.inner.call(request)),
            Check::Reject(rejection) if self.throttle.config.shadow => {
                self.throttle.admit_in_shadow(&rejection);
                ResponseFuture::called(self.inner.call(request))
            }
            Check::Reject(rejection) => self.reject(&request, rejection),
            Check::Wait(decision) => self.park(decision, request),
        }
    }
}

impl<S, Req, K, G, L, C, R> HierarchicalThrottle<S, Req, K, G, L, C, R>
where
    S: Service<Req> + Clone,
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
    R: OnRejection<Req, K, S::Response, S::Error>,
{
    // Both out of line, so `call` stays small enough to inline.

    #[inline(never)]
    fn reject(&self, request: &Req, rejection: Rejection<K>) -> ResponseFuture<S, Req, K, R> {
        ResponseFuture::rejected(self.policy.on_rejection.on_rejection(request, rejection))
    }

    /// The request waits for a batch with the ready service; a clone, maybe not ready, stays.
    #[inline(never)]
    fn park(
        &mut self,
        decision: BoxFuture<'static, Result<(), Rejection<K>>>,
        request: Req,
    ) -> ResponseFuture<S, Req, K, R> {
        let decision = if self.throttle.config.shadow {
            let throttle = self.throttle.clone();
            Box::pin(async move {
                if let Err(rejection) = decision.await {
                    throttle.admit_in_shadow(&rejection);
                }
                Ok(())
            })
        } else {
            decision
        };
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::waiting(decision, inner, request, self.policy.clone())
    }
}

impl<S, Req, K, G, L, C, R> HierarchicalThrottle<S, Req, K, G, L, C, R>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
{
    /// Counters of the decisions made so far, shared with the layer and all its services.
    pub fn stats(&self) -> ThrottleStats {
        self.throttle.stats()
    }

    /// A request with further levels, or without a first-level key.
    #[inline(never)]
    fn check_levels(&self, key: Option<K>, request: &Req, cost: u64) -> Check<K> {
        let key = match key {
            Some(key) => Some(key),
            None => {
                self.throttle.stats.missing_key.incr();
                tracing::debug!(policy = ?self.policy.missing_key_name(), "request without a throttle key");
                match &self.policy.missing_key {
                    MissingKey::Reject => {
                        return Check::Reject(Rejection::new(None, RejectionReason::MissingKey));
                    }
                    MissingKey::Admit => None,
                    MissingKey::UseKey(key) => Some(key.clone()),
                }
            }
        };
        let mut all = AllOf::new(self.throttle.clone(), cost);
        if let Some(key) = key {
            all.check_level(key, 0);
        }
        for (level, key_of) in (1..).zip(self.policy.levels.iter()) {
            if let Some(key) = key_of(request) {
                all.check_level(key, level);
            }
        }
        all.finish()
    }
}

/// Lets a throttled generated service go to `Server::builder().add_service(..)` as itself.
#[cfg(feature = "tonic")]
impl<S, Req, K, G, L, C, R> tonic::server::NamedService
    for HierarchicalThrottle<S, Req, K, G, L, C, R>
where
    S: tonic::server::NamedService,
{
    const NAME: &'static str = S::NAME;
}

//! The throttling service.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_service::Service;

use crate::clock::{Clock, MonotonicClock};
use crate::future::ResponseFuture;
use crate::global::GlobalStore;
use crate::local::LocalStore;
use crate::local::memory::MemoryLocalStore;
use crate::policy::RequestPolicy;
use crate::quota::{BucketKey, LeaseKey};
use crate::rejection::Rejection;
use crate::response::{DefaultRejection, OnRejection};
use crate::stats::ThrottleStats;
use crate::throttle::key::KeyReader;
use crate::throttle::{Admission, Admitted, Check, Decision, Throttle, Viewed};

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
        if self.policy.exempts(&request) {
            return self.exempted(request);
        }
        let cost = self.policy.cost(&request);
        if self.annotates() || self.settles() || self.throttle.shapes() {
            return self.call_annotated(request, cost);
        }
        let check = match &self.policy.key {
            KeyReader::Borrowed(reader) if self.policy.levels.is_empty() => {
                match self.throttle.check_borrowed(&**reader, &request, cost) {
                    Some(check) => check,
                    None => self.check_levels(None, &request, cost),
                }
            }
            key => match key.read(&request) {
                Some(key) if self.policy.levels.is_empty() => self.throttle.check_key(key, cost),
                key => self.check_levels(key, &request, cost),
            },
        };
        match check {
            // The common case first and on its own, so the request moves straight into the
            // inner service (a shared `respond` made the compiler copy it twice on the way).
            Check::Admit => ResponseFuture::called(self.inner.call(request)),
            check => self.respond(check, request, None, cost),
        }
    }
}

/// The first buckets of the keys a request draws on, one per level.
type LevelKeys<K> = Vec<LeaseKey<K>>;

impl<S, Req, K, G, L, C, R> HierarchicalThrottle<S, Req, K, G, L, C, R>
where
    S: Service<Req> + Clone,
    K: Hash + Eq + Clone + Send + Sync + 'static,
    G: GlobalStore<BucketKey<K>>,
    L: LocalStore<LeaseKey<K>>,
    C: Clock,
    R: OnRejection<Req, K, S::Response, S::Error>,
{
    // All out of line, so `call` stays small enough to inline.

    /// Whether admitted responses get the state of their limits.
    #[inline(always)]
    fn annotates(&self) -> bool {
        self.throttle.config.fields.on()
            && OnRejection::<Req, K, S::Response, S::Error>::annotates_admitted(
                &self.policy.on_rejection,
            )
    }

    /// A request whose response gets the state of its limits, or whose cost is settled from
    /// it, or which may wait for its tokens. When only the state is added, on one limit the
    /// same for every key and a borrowed key, the lease's take reads it too (one lookup, no
    /// key made); otherwise the keys are kept ([`call_keyed`](Self::call_keyed)).
    #[inline(never)]
    fn call_annotated(&mut self, request: Req, cost: u64) -> ResponseFuture<S, Req, K, R> {
        let viewed = match &self.policy.key {
            KeyReader::Borrowed(reader)
                if self.policy.levels.is_empty() && !self.settles() && !self.throttle.shapes() =>
            {
                let one_limit = self.policy.one_limit.as_ref();
                self.throttle
                    .check_borrowed_viewed(&**reader, &request, cost, one_limit)
            }
            _ => None,
        };
        match viewed {
            Some(Viewed::Admitted(remaining)) => {
                let admission = Admission {
                    remaining,
                    settle: None,
                };
                self.admitted(request, admission)
            }
            Some(Viewed::Decided(check, first)) => {
                self.respond(check, request, Some(vec![first]), cost)
            }
            Some(Viewed::NoKey) | None => self.call_keyed(request, cost),
        }
    }

    /// A request whose keys are kept: to read the state of its limits for its response once
    /// admitted, or to check them again while it waits for its tokens.
    #[inline(never)]
    fn call_keyed(&mut self, request: Req, cost: u64) -> ResponseFuture<S, Req, K, R> {
        match self.level_keys(self.policy.key.read(&request), &request) {
            Ok(keys) => {
                let check = match keys.as_slice() {
                    [first] if first.level == 0 => self.throttle.check_first_bucket(first, cost),
                    _ => self.throttle.check_keys(&keys, cost),
                };
                self.respond(check, request, Some(keys), cost)
            }
            Err(rejection) => self.respond(Check::reject(rejection), request, None, cost),
        }
    }

    /// Serves, refuses or parks `request` by `check`; `keys` when they are kept (see
    /// [`call_keyed`](Self::call_keyed)).
    #[inline(never)]
    fn respond(
        &mut self,
        check: Check<K>,
        request: Req,
        keys: Option<LevelKeys<K>>,
        cost: u64,
    ) -> ResponseFuture<S, Req, K, R> {
        match check {
            Check::Admit => match keys {
                Some(keys) => {
                    let (annotate, settle) = (self.annotates(), self.settles());
                    let leased = Admitted::LEASED;
                    let admission = self
                        .throttle
                        .admission(keys, cost, leased, annotate, settle);
                    self.admitted(request, admission)
                }
                None => ResponseFuture::called(self.inner.call(request)),
            },
            Check::Reject(rejection) if self.throttle.config.shadow => {
                let admission = self
                    .throttle
                    .admit_in_shadow(&rejection, self.annotates(), keys);
                self.admitted(request, admission)
            }
            Check::Reject(rejection) if keys.is_some() && self.throttle.may_wait(&rejection) => {
                let refused = Box::pin(std::future::ready(Err(*rejection)));
                self.park(refused, request, keys, cost)
            }
            Check::Reject(rejection) => self.reject(&request, rejection),
            Check::Wait(decision) => self.park(decision, request, keys, cost),
        }
    }

    /// A request no limit applies to: straight to the inner service, counted.
    #[inline(never)]
    fn exempted(&mut self, request: Req) -> ResponseFuture<S, Req, K, R> {
        self.throttle.count_exempt();
        ResponseFuture::called(self.inner.call(request))
    }

    #[inline(never)]
    fn admitted(&mut self, request: Req, admission: Admission) -> ResponseFuture<S, Req, K, R> {
        ResponseFuture::admitted(self.inner.call(request), admission, &self.policy)
    }

    /// Whether admitted requests' costs are corrected from their responses.
    #[inline(always)]
    fn settles(&self) -> bool {
        OnRejection::<Req, K, S::Response, S::Error>::settles(&self.policy.on_rejection)
    }

    #[inline(never)]
    fn reject(
        &self,
        request: &Req,
        mut rejection: Box<Rejection<K>>,
    ) -> ResponseFuture<S, Req, K, R> {
        self.throttle.finish_refusal(&mut rejection);
        ResponseFuture::rejected(self.policy.on_rejection.on_rejection(request, *rejection))
    }

    /// The request waits for its decision with the ready service; a clone, maybe not ready,
    /// stays. A throttled decision then waits for its tokens when the layer shapes (`keys`
    /// given); an admitted request gets the state of its limits when annotated, one admitted in
    /// shadow mode its refusal's.
    #[inline(never)]
    fn park(
        &mut self,
        decision: Decision<K>,
        request: Req,
        keys: Option<LevelKeys<K>>,
        cost: u64,
    ) -> ResponseFuture<S, Req, K, R> {
        let throttle = self.throttle.clone();
        let (annotate, settle) = (self.annotates(), self.settles());
        let arrived = tokio::time::Instant::now();
        let decision = Box::pin(async move {
            let decided = match (decision.await, &keys) {
                (Err(refusal), Some(keys)) if throttle.may_wait(&refusal) => {
                    throttle.wait_for_tokens(keys, cost, refusal, arrived).await
                }
                (decided, _) => decided,
            };
            match decided {
                Ok(admitted) => Ok(match keys {
                    Some(keys) => {
                        let admitted = throttle.count_admitted(admitted, cost);
                        throttle.admission(keys, cost, admitted, annotate, settle)
                    }
                    None => {
                        throttle.count_admitted(admitted, cost);
                        Admission::default()
                    }
                }),
                Err(rejection) if throttle.config.shadow => {
                    Ok(throttle.admit_in_shadow(&rejection, annotate, keys))
                }
                Err(mut rejection) => {
                    throttle.finish_refusal(&mut rejection);
                    Err(rejection)
                }
            }
        });
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::waiting(decision, inner, request, self.policy.clone())
    }

    /// Decides `request` on its keys at every level, `first` being the first level's.
    #[inline(never)]
    fn check_levels(&self, first: Option<K>, request: &Req, cost: u64) -> Check<K> {
        match self.level_keys(first, request) {
            Ok(keys) => self.throttle.check_keys(&keys, cost),
            Err(rejection) => Check::reject(rejection),
        }
    }

    /// The keys of `request` at every level, `first` being the first level's (which the
    /// [`MissingKey`] policy decides when absent). A level whose closure gives no key is not
    /// limited.
    #[inline(never)]
    fn level_keys(&self, first: Option<K>, request: &Req) -> Result<LevelKeys<K>, Rejection<K>> {
        let mut keys = Vec::with_capacity(1 + self.policy.levels.len());
        if let Some(key) = self.first_key(first)? {
            keys.push(LeaseKey::new(key, 0, 0));
        }
        for (level, key_of) in (1..).zip(self.policy.levels.iter()) {
            if let Some(key) = key_of(request) {
                keys.push(LeaseKey::new(key, level, 0));
            }
        }
        Ok(keys)
    }

    /// The first level's key, or what the [`MissingKey`] policy makes of its absence.
    fn first_key(&self, key: Option<K>) -> Result<Option<K>, Rejection<K>> {
        if key.is_some() {
            return Ok(key);
        }
        self.throttle
            .note_missing_key(self.policy.missing_key_name());
        self.policy.missing_key.resolve()
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
}

/// Lets a throttled generated service go to `Server::builder().add_service(..)` as itself.
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
impl<S, Req, K, G, L, C, R> tonic::server::NamedService
    for HierarchicalThrottle<S, Req, K, G, L, C, R>
where
    S: tonic::server::NamedService,
{
    const NAME: &'static str = S::NAME;
}

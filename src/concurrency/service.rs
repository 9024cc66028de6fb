//! The service of [`HierarchicalConcurrencyLayer`].

use std::hash::Hash;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::clock::Clock;
use crate::concurrency::future::ResponseFuture;
use crate::concurrency::{HierarchicalConcurrencyLayer, SlotBody};
use crate::global::slots::SlotStore;
use crate::in_flight::Acquired;
use crate::quota::BucketKey;
use crate::response::{DefaultRejection, OnRejection};

/// A service that limits each key to a number of requests in flight, fleet-wide; made by
/// [`HierarchicalConcurrencyLayer`]. Clones share the layer's slots.
pub struct HierarchicalConcurrency<Inner, Req, K, S, C, R = DefaultRejection> {
    inner: Inner,
    layer: HierarchicalConcurrencyLayer<Req, K, S, C, R>,
}

impl<Inner, Req, K, S, C, R> HierarchicalConcurrency<Inner, Req, K, S, C, R> {
    /// Wraps `inner` with the limits of `layer` (sharing its slots).
    pub fn new(inner: Inner, layer: HierarchicalConcurrencyLayer<Req, K, S, C, R>) -> Self {
        Self { inner, layer }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &Inner {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut Inner {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> Inner {
        self.inner
    }

    /// The layer whose slots this service shares.
    pub fn layer(&self) -> &HierarchicalConcurrencyLayer<Req, K, S, C, R> {
        &self.layer
    }
}

impl<Inner: Clone, Req, K, S, C, R> Clone for HierarchicalConcurrency<Inner, Req, K, S, C, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<Inner, Req, K, S, C, R> std::fmt::Debug for HierarchicalConcurrency<Inner, Req, K, S, C, R>
where
    Inner: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HierarchicalConcurrency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<Inner, ReqB, ResB, K, S, C, R> Service<Request<ReqB>>
    for HierarchicalConcurrency<Inner, Request<ReqB>, K, S, C, R>
where
    Inner: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    ReqB: Send + 'static,
    ResB: Default + 'static,
    K: Hash + Eq + Clone + Send + Sync + 'static,
    S: SlotStore<BucketKey<K>>,
    C: Clock,
    R: OnRejection<Request<ReqB>, K, Response<ResB>, Inner::Error> + Send + Sync + 'static,
{
    type Response = Response<SlotBody<ResB>>;
    type Error = Inner::Error;
    type Future = ResponseFuture<Inner, Request<ReqB>, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let shared = &self.layer.shared;
        if shared.exempts(&request) {
            return ResponseFuture::calling(self.inner.call(request), None, None);
        }
        let key = match (shared.key)(&request)
            .map_or_else(|| shared.missing_key.resolve(), |k| Ok(Some(k)))
        {
            Ok(Some(key)) => key,
            Ok(None) => return ResponseFuture::calling(self.inner.call(request), None, None),
            // Shadow mode: a request without a key is served too, counted.
            Err(_) if shared.shadow => {
                shared.engine.count_shadow_admitted();
                return ResponseFuture::calling(self.inner.call(request), None, None);
            }
            Err(rejection) => {
                return ResponseFuture::answered(
                    shared.on_rejection.on_rejection(&request, rejection),
                );
            }
        };
        match shared.engine.try_acquire(&key) {
            Acquired::Now(permit) => {
                let fields = shared.admitted_fields(&key);
                ResponseFuture::calling(self.inner.call(request), Some(permit), fields)
            }
            Acquired::Refused(no_slot) => {
                let fields = shared
                    .shadow
                    .then(|| shared.admitted_fields(&key))
                    .flatten();
                match shared.refuse(&request, key, no_slot) {
                    Some(answer) => ResponseFuture::answered(answer),
                    // Shadow mode: served without a slot, its fields those of its refusal.
                    None => ResponseFuture::calling(self.inner.call(request), None, fields),
                }
            }
            Acquired::Wait(wait) => {
                // The ready service goes with the request; a clone may not be ready.
                let clone = self.inner.clone();
                let service = std::mem::replace(&mut self.inner, clone);
                let fields = shared.admitted_fields(&key);
                let layer = self.layer.clone();
                let refuse = Box::new(move |no_slot, request: &Request<ReqB>| {
                    layer.shared.refuse(request, key, no_slot)
                });
                ResponseFuture::waiting(wait, (service, request), refuse, fields)
            }
        }
    }
}

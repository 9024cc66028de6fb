//! How a request becomes keys and a cost, and a rejection a response: what the tower surface
//! reads from each request before the engine decides.

use crate::key::MissingKey;
use crate::remaining::Remaining;
use crate::throttle::key::{KeyFn, KeyReader};

/// A closure giving a request's cost in tokens.
pub(crate) type CostFn<Req> = Box<dyn Fn(&Req) -> u64 + Send + Sync>;

/// A closure telling which requests no limit applies to.
pub(crate) type ExemptFn<Req> = Box<dyn Fn(&Req) -> bool + Send + Sync>;

/// How a request becomes keys and a cost, and a rejection a response.
pub(crate) struct RequestPolicy<Req, K, R> {
    pub(crate) key: KeyReader<Req, K>,
    /// The key closures of the levels after the first.
    pub(crate) levels: Box<[KeyFn<Req, K>]>,
    pub(crate) cost: Option<CostFn<Req>>,
    /// Requests passed straight to the inner service, before their key is read.
    pub(crate) exempt: Option<ExemptFn<Req>>,
    pub(crate) missing_key: MissingKey<K>,
    pub(crate) on_rejection: R,
    /// The layer's one limit as the fields describe it, when its quota is one limit the same
    /// for every key (made once by the throttle, at build): a request on it reads its state in
    /// the lease's take, and its admitted response carries only that state.
    pub(crate) one_limit: Option<Remaining>,
}

impl<Req, K, R> RequestPolicy<Req, K, R> {
    pub(crate) fn cost(&self, request: &Req) -> u64 {
        self.cost.as_ref().map_or(1, |cost| cost(request))
    }

    /// Whether `request` is exempt from every limit.
    #[inline(always)]
    pub(crate) fn exempts(&self, request: &Req) -> bool {
        self.exempt.as_ref().is_some_and(|exempt| exempt(request))
    }

    pub(crate) fn missing_key_name(&self) -> &'static str {
        match self.missing_key {
            MissingKey::Reject | MissingKey::RejectWith { .. } => "reject",
            MissingKey::Admit => "admit",
            MissingKey::UseKey(_) => "use a shared key",
        }
    }
}

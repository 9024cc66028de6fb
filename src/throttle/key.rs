//! Reading a request's first-level key: made by a closure, or borrowed from the request and
//! looked up in the default local store without being made.

use std::marker::PhantomData;

use crate::key::BorrowedKey;
use crate::limit::Limit;
use crate::local::memory::{GroupHit, MemoryLocalStore};
use crate::local::{LocalBucket, View};

/// A closure making a request's key.
pub(crate) type KeyFn<Req, K> = Box<dyn Fn(&Req) -> Option<K> + Send + Sync>;

/// How the layer reads a request's first-level key.
pub(crate) enum KeyReader<Req, K> {
    /// A closure making the key ([`key`](crate::Builder::key)).
    Owned(KeyFn<Req, K>),
    /// A closure borrowing it from the request ([`key_ref`](crate::Builder::key_ref)).
    Borrowed(Box<dyn ReadBorrowed<Req, K>>),
}

impl<Req, K> KeyReader<Req, K> {
    /// The request's key, made.
    pub(crate) fn read(&self, request: &Req) -> Option<K> {
        match self {
            Self::Owned(key) => key(request),
            Self::Borrowed(reader) => reader.owned(request),
        }
    }
}

/// A key closure that borrows its key from the request, with the key's type erased.
pub(crate) trait ReadBorrowed<Req, K>: Send + Sync {
    /// The request's key, made.
    fn owned(&self, request: &Req) -> Option<K>;

    /// Takes `cost` from the request's key's buckets in `store` by the borrowed key. `None`
    /// when the request has no key. Only the store's small answer comes back: a caller that
    /// needs the key makes it with [`owned`](Self::owned) (returning the key from here cost
    /// every admitted request a stall on the stack copy of the answer).
    fn take(&self, request: &Req, store: &MemoryLocalStore<K>, cost: u64) -> Option<GroupHit>;

    /// [`take`](Self::take), and the view of the key's first bucket once taken (`None` when
    /// this host holds no bucket of the key), read at `at`.
    fn take_viewed(
        &self,
        request: &Req,
        store: &MemoryLocalStore<K>,
        cost: u64,
        at: &ViewAt,
    ) -> Option<(GroupHit, Option<View>)>;
}

/// What a bucket's [`View`] is read with: the time, the bucket's limit, and whether the
/// global store is up (while it is down, a host that decides alone views its share).
pub(crate) struct ViewAt {
    pub(crate) now: u64,
    pub(crate) limit: Limit,
    pub(crate) store_up: bool,
}

/// A closure borrowing a `Q` from the request, for a key of type `Q::Key`.
pub(crate) struct BorrowKey<F, Q: ?Sized> {
    key: F,
    borrowed: PhantomData<fn(&Q)>,
}

impl<F, Q: ?Sized> BorrowKey<F, Q> {
    pub(crate) fn new(key: F) -> Self {
        Self {
            key,
            borrowed: PhantomData,
        }
    }
}

impl<Req, Q, F> ReadBorrowed<Req, Q::Key> for BorrowKey<F, Q>
where
    F: for<'r> Fn(&'r Req) -> Option<&'r Q> + Send + Sync,
    Q: BorrowedKey + ?Sized,
{
    fn owned(&self, request: &Req) -> Option<Q::Key> {
        (self.key)(request).map(BorrowedKey::to_key)
    }

    #[inline]
    fn take(&self, request: &Req, store: &MemoryLocalStore<Q::Key>, cost: u64) -> Option<GroupHit> {
        Some(store.take_group_by::<Q>((self.key)(request)?, 0, cost))
    }

    fn take_viewed(
        &self,
        request: &Req,
        store: &MemoryLocalStore<Q::Key>,
        cost: u64,
        at: &ViewAt,
    ) -> Option<(GroupHit, Option<View>)> {
        let key = (self.key)(request)?;
        let view = |b: &LocalBucket| b.view(at.now, &at.limit, at.store_up);
        Some(store.take_group_then::<Q, _>(key, 0, cost, view))
    }
}

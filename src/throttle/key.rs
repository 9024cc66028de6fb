//! Reading a request's first-level key: made by a closure, or borrowed from the request and
//! looked up in the default local store without being made.

use std::marker::PhantomData;

use crate::key::BorrowedKey;
use crate::local::memory::{GroupHit, MemoryLocalStore};

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
}

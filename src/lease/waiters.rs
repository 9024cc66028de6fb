//! The requests waiting for a key's batch.

use super::Waiter;

/// Requests waiting for the batch being fetched, in arrival order.
pub(super) struct Waiters {
    // Behind one thin pointer, as reserved tranches are: the slow path's state stays in its
    // allocation class. Requests wait only while a batch is fetched; `None` when none does.
    #[expect(
        clippy::box_collection,
        reason = "a thin pointer keeps the slow path's state in its allocation class"
    )]
    queue: Option<Box<Vec<Waiter>>>,
}

impl Waiters {
    pub(super) const NONE: Self = Self { queue: None };

    pub(super) fn push(&mut self, waiter: Waiter) {
        self.queue.get_or_insert_default().push(waiter);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queue.as_ref().is_none_or(|queue| queue.is_empty())
    }

    pub(super) fn len(&self) -> usize {
        self.queue.as_ref().map_or(0, |queue| queue.len())
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.queue.iter().flat_map(|queue| queue.iter())
    }

    /// Drops the requests that have gone away.
    pub(super) fn retain_present(&mut self) {
        if let Some(queue) = &mut self.queue {
            queue.retain(|w| !w.is_gone());
            if queue.is_empty() {
                self.queue = None;
            }
        }
    }

    /// Takes every waiting request out, in arrival order.
    pub(super) fn take(&mut self) -> Vec<Waiter> {
        self.queue.take().map_or_else(Vec::new, |queue| *queue)
    }

    /// Puts `waiters` back to wait for another batch.
    pub(super) fn set(&mut self, waiters: Vec<Waiter>) {
        self.queue = (!waiters.is_empty()).then(|| Box::new(waiters));
    }
}

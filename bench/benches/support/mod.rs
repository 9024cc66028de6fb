//! What the benchmarks share: the keys they spread over, and polling a ready future.

use std::task::{Context, Poll};

/// How long a warm-up waits for the batches its requests started to land: past the default
/// `global_batch_linger` (250 ms), for which the fetch paying a cold key's credit waits, and
/// the in-memory store's answer.
pub const BATCHES_LAND: std::time::Duration = std::time::Duration::from_millis(300);

/// `n` keys spread so that consecutive iterations do not touch neighbouring slots.
pub fn keys(n: u64) -> Vec<u64> {
    (0..n)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect()
}

/// Polls a future once, as a server would on an answer that is ready: inlined on every side,
/// so none pays a call that another does not.
#[inline(always)]
pub fn poll_once<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut context = Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut context) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

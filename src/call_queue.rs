//! Store calls batched across keys, for both engines: the calls that fall due together go to
//! the store in one round trip, at most the engine's batch size at a time. Each call has a time
//! it falls due, and the queue goes when the first of its calls does, or at once when it fills a
//! batch. A call a request waits on falls due with the next scheduler turn, taking every queued
//! call along; a call nothing waits on ([`Due::Behind`]) may wait a while for others to join it,
//! until a request starts waiting on any call ([`expedite`]). Each call keeps its own answer and
//! failure; the batch as a whole has the store time-out from when it is sent, after which its
//! unanswered calls end without an answer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::sync::lock;

/// The engine a [`CallQueue`] sends for: where its queue is, how it sends a batch, and what it
/// does with an answer nobody takes.
pub(crate) trait SendsCalls: Send + Sync + Sized + 'static {
    /// A call to the store.
    type Call: Send + 'static;
    /// Its answer, as the caller takes it.
    type Answer: Send + 'static;

    fn queue(&self) -> &CallQueue<Self::Call, Self::Answer>;

    /// The most calls in one round trip.
    fn max_batch(&self) -> usize;

    fn store_timeout(&self) -> Duration;

    /// The engine's time (micros), read as a batch leaves.
    fn now(&self) -> u64;

    /// Sends `calls` in one round trip; each answer comes with its call's index.
    fn send(&self, calls: Vec<Self::Call>) -> impl Stream<Item = (usize, Self::Answer)> + Send;

    /// A batch left for the store.
    fn count_round_trip(&self);

    /// An answer whose caller went away.
    fn undelivered(&self, _answer: Self::Answer) {}
}

/// A call's answer, `None` when it has none (no answer within the store time-out, or its batch
/// never ran: no runtime, or the runtime shut down), and when its batch left for the store (in
/// the engine's clock).
pub(crate) struct Reply<A> {
    pub(crate) sent_at: u64,
    pub(crate) answer: Option<A>,
}

/// When a call may go to the store.
#[derive(Clone, Copy)]
pub(crate) enum Due {
    /// A request waits on it: with the next scheduler turn.
    Now,
    /// Nothing waited on it when it was planned, at which time the queue's
    /// [`expedites`](CallQueue::expedites) was `since`: it may wait up to `within` for others to
    /// join its batch, unless a request started waiting since (it may be waiting on this call).
    Behind { since: u64, within: Duration },
}

/// Calls waiting for the next batch.
pub(crate) struct CallQueue<C, A> {
    state: Mutex<Queue<C, A>>,
    /// How many times a request started waiting on a call: a call planned with nothing waiting
    /// on it lingers only if no request started waiting since (see [`Due::Behind`]).
    expedites: AtomicU64,
}

/// A queued call, where its answer goes, when it falls due, and its number in the queue's order.
struct Pending<C, A> {
    call: C,
    sender: oneshot::Sender<Reply<A>>,
    at: Instant,
    number: u64,
}

/// The calls in the order they came. Every operation on it is bounded by a batch, not by the
/// calls queued (a key flood can queue a hundred thousand): a batch is taken from the front,
/// the next time to go is looked for only among fewer than a batch, and an expedite marks
/// the calls queued so far with one number.
struct Queue<C, A> {
    pending: VecDeque<Pending<C, A>>,
    /// Calls queued so far.
    queued: u64,
    /// The calls numbered up to this one fall due at once: a request started waiting while
    /// they were queued.
    expedited_through: u64,
    /// When the queued calls go: the earliest time one of them falls due. `None` when empty.
    due_at: Option<Instant>,
    /// Counts the flushes scheduled: a flush task whose number is not the latest finds its
    /// calls taken (or due earlier, by a flush of its own) and leaves.
    window: u64,
}

impl<C, A> Default for CallQueue<C, A> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queue {
                pending: VecDeque::new(),
                queued: 0,
                expedited_through: 0,
                due_at: None,
                window: 0,
            }),
            expedites: AtomicU64::new(0),
        }
    }
}

impl<C, A> CallQueue<C, A> {
    /// How many times a request started waiting on a call so far: read before planning a call
    /// nothing waits on ([`Due::Behind`]).
    pub(crate) fn expedites(&self) -> u64 {
        self.expedites.load(Ordering::SeqCst)
    }

    /// Drops every queued call unanswered.
    fn clear(&self) {
        lock(&self.state).drop_all();
    }
}

impl<C, A> Queue<C, A> {
    /// Drops every queued call unanswered: their callers see their senders go.
    fn drop_all(&mut self) {
        self.pending.clear();
        self.due_at = None;
    }

    /// Makes `at` the time the queued calls go if it is sooner than the one set; returns the
    /// window a flush must be scheduled for.
    fn due(&mut self, at: Instant) -> Option<u64> {
        if self.due_at.is_some_and(|due| due <= at) {
            return None;
        }
        self.due_at = Some(at);
        self.window = self.window.wrapping_add(1);
        Some(self.window)
    }

    fn push(&mut self, call: C, sender: oneshot::Sender<Reply<A>>, at: Instant) {
        self.queued += 1;
        self.pending.push_back(Pending {
            call,
            sender,
            at,
            number: self.queued,
        });
    }

    /// When the first of the queued calls falls due (`None`: none queued); `now` if they fill
    /// a batch of `max_batch`.
    fn next_due(&self, now: Instant, max_batch: usize) -> Option<Instant> {
        let first = self.pending.front()?;
        if self.pending.len() >= max_batch || first.number <= self.expedited_through {
            return Some(now);
        }
        self.pending.iter().map(|p| p.at).min()
    }
}

/// Makes `call` with a batch of `engine`'s calls, sent when `due` says, and waits for its reply.
pub(crate) async fn call<E: SendsCalls>(
    engine: &Arc<E>,
    call: E::Call,
    due: Due,
) -> Reply<E::Answer> {
    let (sender, receiver) = oneshot::channel();
    let now = Instant::now();
    let queue = engine.queue();
    let at = match due {
        Due::Behind { since, within } if queue.expedites() == since => now + within,
        _ => now,
    };
    let (window, at) = {
        let mut state = lock(&queue.state);
        state.push(call, sender, at);
        // A full batch goes at once.
        let at = match state.pending.len() >= engine.max_batch() {
            true => now,
            false => at,
        };
        (state.due(at), at)
    };
    if let Some(window) = window {
        schedule_flush(engine, window, at);
    }
    receiver.await.unwrap_or_else(|_| Reply {
        sent_at: engine.now(),
        answer: None,
    })
}

/// A request started waiting on a call of `engine`'s queue (one it joined): calls that were
/// lingering go now.
pub(crate) fn expedite<E: SendsCalls>(engine: &Arc<E>) {
    let queue = engine.queue();
    queue.expedites.fetch_add(1, Ordering::SeqCst);
    let now = Instant::now();
    let window = {
        let mut state = lock(&queue.state);
        // Every queued call, as the one waited on may not fit in the next batch.
        state.expedited_through = state.queued;
        match state.due_at {
            Some(_) => state.due(now),
            None => None,
        }
    };
    if let Some(window) = window {
        schedule_flush(engine, window, now);
    }
}

/// Runs the batch of flush `window` at `at` in a task of its own; without a runtime, the queued
/// calls end unanswered.
fn schedule_flush<E: SendsCalls>(engine: &Arc<E>, window: u64, at: Instant) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(flush(engine.clone(), window, at));
        }
        Err(_) => engine.queue().clear(),
    }
}

async fn flush<E: SendsCalls>(engine: Arc<E>, window: u64, at: Instant) {
    let mut unflushed = Unflushed {
        queue: engine.queue(),
        window: Some(window),
    };
    if at <= Instant::now() {
        // Calls queued by the tasks already scheduled join this batch.
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep_until(at).await;
    }
    let max_batch = engine.max_batch();
    let (batch, rest) = {
        let mut state = lock(&engine.queue().state);
        if state.window != window {
            // Another flush took these calls, or takes them sooner.
            return;
        }
        let n = state.pending.len().min(max_batch);
        let batch: Vec<_> = state.pending.drain(..n).collect();
        state.due_at = None;
        unflushed.window = None;
        // The rest go when the first of them falls due (at once if they fill a batch).
        let rest = state.next_due(Instant::now(), max_batch);
        let window = rest.and_then(|at| state.due(at));
        (batch, window.zip(rest))
    };
    if let Some((window, at)) = rest {
        schedule_flush(&engine, window, at);
    }
    if batch.is_empty() {
        // An earlier flush took them.
        return;
    }
    engine.count_round_trip();
    let sent_at = engine.now();
    let (calls, senders): (Vec<_>, Vec<_>) = batch
        .into_iter()
        .map(|pending| (pending.call, pending.sender))
        .unzip();
    let mut senders: Vec<_> = senders.into_iter().map(Some).collect();
    let deadline = Instant::now() + engine.store_timeout();
    let answers = engine.send(calls);
    let mut answers = std::pin::pin!(answers);
    while let Ok(Some((i, answer))) = tokio::time::timeout_at(deadline, answers.next()).await {
        let Some(sender) = senders.get_mut(i).and_then(Option::take) else {
            continue;
        };
        let reply = Reply {
            sent_at,
            answer: Some(answer),
        };
        if let Err(Reply {
            answer: Some(answer),
            ..
        }) = sender.send(reply)
        {
            engine.undelivered(answer);
        }
    }
    // Calls still unanswered end without an answer (their futures are dropped with the batch).
    for sender in senders.into_iter().flatten() {
        let _gone = sender.send(Reply {
            sent_at,
            answer: None,
        });
    }
}

/// A flush task's window until it takes its calls: if the task is dropped first (its runtime
/// shut down), its calls end unanswered and the queue schedules afresh, rather than waiting for
/// a flush that will never run.
struct Unflushed<'a, C, A> {
    queue: &'a CallQueue<C, A>,
    window: Option<u64>,
}

impl<C, A> Drop for Unflushed<'_, C, A> {
    fn drop(&mut self) {
        let Some(window) = self.window else {
            return;
        };
        let mut state = lock(&self.queue.state);
        if state.window == window {
            state.drop_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use futures_util::{Stream, StreamExt};
    use tokio::time::Instant;

    use super::{CallQueue, Due, SendsCalls, call, expedite};
    use crate::sync::lock;

    const TIMEOUT: Duration = Duration::from_millis(50);

    #[test]
    fn the_next_time_to_go_is_read_from_the_front_the_expedite_mark_and_a_full_batch() {
        let queue = CallQueue::<u32, ()>::default();
        let mut state = lock(&queue.state);
        let now = Instant::now();
        let linger = |ms| now + Duration::from_millis(ms);
        let push = |state: &mut super::Queue<u32, ()>, at| {
            state.push(0, tokio::sync::oneshot::channel().0, at);
        };
        assert_eq!(state.next_due(now, 4), None, "nothing queued");
        push(&mut state, linger(250));
        push(&mut state, linger(100));
        assert_eq!(
            state.next_due(now, 4),
            Some(linger(100)),
            "the first to fall due"
        );
        // A request started waiting: the calls queued so far go now, later ones may linger.
        state.expedited_through = state.queued;
        push(&mut state, linger(300));
        assert_eq!(state.next_due(now, 4), Some(now));
        state.pending.drain(..2);
        assert_eq!(
            state.next_due(now, 4),
            Some(linger(300)),
            "only the later call left"
        );
        for _ in 0..3 {
            push(&mut state, linger(300));
        }
        assert_eq!(
            state.next_due(now, 4),
            Some(now),
            "a full batch goes at once"
        );
    }

    /// A store that answers each call `n` with `10 n` after `delay`, and records its batches
    /// and when they left.
    struct Echo {
        queue: CallQueue<u32, u32>,
        max_batch: usize,
        delay: Duration,
        start: Instant,
        batches: Mutex<Vec<(Duration, Vec<u32>)>>,
        undelivered: AtomicU64,
    }

    fn echo(max_batch: usize, delay: Duration) -> Arc<Echo> {
        Arc::new(Echo {
            queue: CallQueue::default(),
            max_batch,
            delay,
            start: Instant::now(),
            batches: Mutex::new(Vec::new()),
            undelivered: AtomicU64::new(0),
        })
    }

    impl SendsCalls for Echo {
        type Call = u32;
        type Answer = u32;

        fn queue(&self) -> &CallQueue<u32, u32> {
            &self.queue
        }

        fn max_batch(&self) -> usize {
            self.max_batch
        }

        fn store_timeout(&self) -> Duration {
            TIMEOUT
        }

        fn now(&self) -> u64 {
            crate::clock::micros(self.start.elapsed())
        }

        fn send(&self, calls: Vec<u32>) -> impl Stream<Item = (usize, u32)> + Send {
            lock(&self.batches).push((self.start.elapsed(), calls.clone()));
            let delay = self.delay;
            futures_util::stream::iter(calls.into_iter().enumerate()).then(
                move |(i, n)| async move {
                    tokio::time::sleep(delay).await;
                    (i, n * 10)
                },
            )
        }

        fn count_round_trip(&self) {}

        fn undelivered(&self, _answer: u32) {
            self.undelivered.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn batches(engine: &Echo) -> Vec<(Duration, Vec<u32>)> {
        lock(&engine.batches).clone()
    }

    #[tokio::test(start_paused = true)]
    async fn calls_of_one_turn_go_together_at_most_a_batch_at_a_time() {
        let engine = echo(4, Duration::ZERO);
        let calls = (1..=10).map(|n| call(&engine, n, Due::Now));
        let replies = futures_util::future::join_all(calls).await;
        let answers: Vec<_> = replies.iter().map(|r| r.answer).collect();
        assert_eq!(answers, (1..=10).map(|n| Some(n * 10)).collect::<Vec<_>>());
        let sizes: Vec<_> = batches(&engine).iter().map(|(_, b)| b.len()).collect();
        assert_eq!(sizes, [4, 4, 2]);
        assert!(batches(&engine).iter().all(|(at, _)| at.is_zero()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_nothing_waits_on_lingers_until_due() {
        let engine = echo(8, Duration::ZERO);
        let within = Duration::from_millis(100);
        let since = engine.queue.expedites();
        let reply = call(&engine, 7, Due::Behind { since, within }).await;
        assert_eq!(reply.answer, Some(70));
        assert_eq!(batches(&engine), [(within, vec![7])]);
        assert_eq!(reply.sent_at, 100_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_starts_waiting_sends_the_lingering_calls_at_once() {
        let engine = echo(8, Duration::ZERO);
        let since = engine.queue.expedites();
        let within = Duration::from_millis(100);
        let lingering = tokio::spawn({
            let engine = engine.clone();
            async move { call(&engine, 1, Due::Behind { since, within }).await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(batches(&engine).is_empty(), "still lingering at 30 ms");
        expedite(&engine);
        assert_eq!(lingering.await.unwrap().answer, Some(10));
        assert_eq!(batches(&engine), [(Duration::from_millis(30), vec![1])]);
        // Planned before that request came, a call nothing waits on goes at once too.
        let late = call(&engine, 2, Due::Behind { since, within }).await;
        assert_eq!(late.answer, Some(20));
        assert_eq!(batches(&engine)[1].0, Duration::from_millis(30));
    }

    #[tokio::test(start_paused = true)]
    async fn calls_unanswered_within_the_store_time_out_end_without_an_answer() {
        let engine = echo(8, TIMEOUT + Duration::from_millis(1));
        tokio::time::sleep(Duration::from_millis(5)).await;
        let reply = call(&engine, 3, Due::Now).await;
        assert_eq!(reply.answer, None);
        assert_eq!(reply.sent_at, 5_000, "when its batch left");
        assert_eq!(engine.start.elapsed(), Duration::from_millis(55));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_whose_caller_left_goes_to_the_engine() {
        let engine = echo(8, Duration::from_millis(10));
        let caller = tokio::spawn({
            let engine = engine.clone();
            async move { call(&engine, 4, Due::Now).await }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        caller.abort();
        assert!(caller.await.is_err_and(|e| e.is_cancelled()));
        // Answered at 10 ms, to nobody.
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(engine.undelivered.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn without_a_runtime_a_call_ends_at_once_without_an_answer() {
        let engine = echo(8, Duration::ZERO);
        let mut reply = std::pin::pin!(call(&engine, 5, Due::Now));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match reply.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(reply) => assert_eq!(reply.answer, None),
            std::task::Poll::Pending => panic!("waits for a flush that cannot run"),
        }
        // The queue is left empty: nothing waits for a flush.
        assert!(lock(&engine.queue.state).pending.is_empty());
    }
}

//! One key's concurrency slots on one host, as a pure state machine: no I/O, no clock, no
//! locks, no spawns. The engine ([`in_flight`](crate::in_flight)) reads the clock, calls the
//! slot store and delivers what this machine decides.
//!
//! # Ground rules
//!
//! - A host may have in flight at most the slots the store holds for it, and only until its
//!   holding expires (`usable_until`, counted from when the call that set it was sent, so it
//!   ends before the store's own expiry). Requests already running when a holding expires run
//!   on; new ones wait for a call.
//! - A call sets the host's holding to an absolute number (`want`), never adds to it, and the
//!   store never cuts a holding below what the host holds up to `want`, whatever limit the
//!   call carries: a lost, late or repeated call (one sent before the limit was raised,
//!   applied after the others took the new slots) can only leave the store holding more for
//!   the host than it uses. While a call is out, the host uses no more than the smaller of
//!   what the store confirmed and what the call asks for, so the store may apply it at any
//!   moment.
//! - The limit bounds what a host admits, not what it keeps: a host admits no more than the
//!   room the store's last answer left it (the limit less what the others held), so a
//!   holding above a lowered limit runs down as its requests end and is given back. Such a
//!   host asks for no more than it may use, waiters or not: asked for, the rest would be
//!   kept, and hosts each keeping a slot that the others' holdings leave no room to use
//!   would admit nothing.
//! - One call per key is out at a time. A request that finds no free slot waits for the next
//!   answer; it is refused only when an answer sent after it arrived says the fleet is full.
//! - The one exception, when the layer gives credit ([`ColdStart::Credit`]): a key not known
//!   to be full may have up to `credit` requests in flight beyond what its holding covers,
//!   each admitted at once while a call asks the store to hold them. So a key has at most
//!   its limit plus each host's credit in flight fleet-wide, and only while it is full.
//!
//! [`ColdStart::Credit`]: crate::ColdStart::Credit
//!
//! It holds a oneshot sender per waiting request (`W`) and nothing else asynchronous.

use std::collections::VecDeque;

use crate::clock::Now;

#[cfg(test)]
pub(crate) mod tests;

/// A call to the slot store that the engine is to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotCall {
    /// Orders the host's calls at the store: a call older than one already applied is ignored.
    pub(crate) seq: u64,
    /// The holding asked for, absolute.
    pub(crate) want: u64,
    /// When it was sent (host microseconds).
    pub(crate) sent_at: u64,
}

/// What a request finds when it looks for a slot.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TryTake {
    /// A free slot is its own.
    Taken,
    /// Admitted on credit, beyond what the holding covers: [`SlotLease::ask`] for it.
    OnCredit,
    /// The store failed a moment ago: the failure policy's cap on this host decided.
    Fallback {
        /// Whether it is admitted (it then holds a slot of `in_use`).
        admitted: bool,
    },
    /// It must wait for the store: [`SlotLease::wait`].
    MustWait,
}

/// The requests an answer (or a failure) decides, and the next call to make.
#[derive(Debug)]
pub(crate) struct Decided<W> {
    /// Admitted: each now holds a slot.
    pub(crate) admitted: Vec<W>,
    /// Refused: the fleet was full after they arrived.
    pub(crate) full: Vec<W>,
    /// Refused: the store failed and the failure policy's cap is reached.
    pub(crate) unavailable: Vec<W>,
    /// The call to make next, if any.
    pub(crate) next: Option<SlotCall>,
}

impl<W> Default for Decided<W> {
    fn default() -> Self {
        Self {
            admitted: Vec::new(),
            full: Vec::new(),
            unavailable: Vec::new(),
            next: None,
        }
    }
}

/// One key's slots on one host.
#[derive(Debug)]
pub(crate) struct SlotLease<W> {
    /// Requests admitted and not yet ended.
    in_use: u64,
    /// What the store last confirmed holding for this host.
    held: u64,
    /// What of it may admit: `held`, never past `room` (kept with both, off the hot path).
    admits: u64,
    /// What the other hosts held at the store's last answer.
    others: u64,
    /// Until when `held` may admit new requests (host microseconds).
    usable_until: u64,
    /// The call out, if any.
    call: Option<SlotCall>,
    /// Requests waiting for the call's answer, first come first, with when they came.
    waiters: VecDeque<(W, u64)>,
    /// The store failed: until then requests are decided by `fallback_cap` without a call.
    down_until: u64,
    /// How many requests this host admits on its own while the store fails.
    fallback_cap: u64,
    /// The most requests in flight since the last sweep, and in the pass before it: what a
    /// sweep keeps of the holding (so a free slot lingers one or two passes).
    peak: u64,
    last_peak: u64,
    /// A call failed after the store may have applied it: the store may hold more for this
    /// host than it counts on, until a call sets the holding again.
    uncertain: bool,
    /// Requests wait for a slot (up to their own deadline) instead of being refused when the
    /// fleet is full: the sweep asks again for them every pass.
    patient: bool,
    /// How many requests may be in flight beyond what the holding covers (see the ground
    /// rules), while the key is not known to be full.
    credit: u64,
    /// The store's last answer left no slot free in the fleet: no credit until one does.
    full: bool,
    /// The most this host may have in flight by the store's last answer: the limit less what
    /// the others held then (`u64::MAX` before any answer). Neither the holding nor credit
    /// admits past it.
    room: u64,
}

impl<W> SlotLease<W> {
    /// No slots held, none in use; `fallback_cap` is the failure policy's share for one host
    /// and `credit` what the key may run beyond its holding (see [`set_caps`](Self::set_caps)).
    pub(crate) fn new(fallback_cap: u64, credit: u64, patient: bool) -> Self {
        Self {
            in_use: 0,
            held: 0,
            admits: 0,
            others: 0,
            usable_until: 0,
            call: None,
            waiters: VecDeque::new(),
            down_until: 0,
            fallback_cap,
            peak: 0,
            last_peak: 0,
            uncertain: false,
            patient,
            credit,
            full: false,
            room: u64::MAX,
        }
    }

    /// The failure policy's share of the key's limit as it is now, and the credit the key has
    /// on this host.
    pub(crate) fn set_caps(&mut self, fallback_cap: u64, credit: u64) {
        self.fallback_cap = fallback_cap;
        self.credit = credit;
    }

    /// Requests in flight on this host.
    pub(crate) fn in_use(&self) -> u64 {
        self.in_use
    }

    /// Notes an answer of the store (any answer, even to a call superseded since: it is the
    /// latest word on the fleet) for a limit of `max`: what the other hosts held, and what it
    /// held for this host. It left no slot free in the fleet when the two fill the limit.
    pub(crate) fn note_others(&mut self, others: u64, held: u64, max: u64) {
        self.others = others;
        self.full = others.saturating_add(held) >= max;
        self.room = max.saturating_sub(others);
        self.admits = self.held.min(self.room);
    }

    /// Slots of `max` this host sees free: what the other hosts held at the store's last
    /// answer and this host's requests in flight taken out; while the store fails, what the
    /// failure policy's share leaves. The clock (`now`) is read only after a failure.
    pub(crate) fn free(&self, max: u64, now: impl FnOnce() -> u64) -> u64 {
        let failing = self.down_until != 0 && now() < self.down_until;
        let room = match failing {
            true => self.fallback_cap.min(max),
            false => max.saturating_sub(self.others),
        };
        room.saturating_sub(self.in_use)
    }

    /// Slots the store last confirmed for this host.
    #[cfg(test)]
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    /// The call out, if any.
    #[cfg(test)]
    pub(crate) fn call_out(&self) -> Option<SlotCall> {
        self.call
    }

    /// Requests waiting for the store.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// How many requests may be in flight now on what the store holds.
    fn usable(&self, now: u64) -> u64 {
        if now >= self.usable_until {
            return 0;
        }
        self.usable_while_held()
    }

    /// How many requests may be in flight on what the store holds, while it holds it: never
    /// past the room the last answer left (a holding above it, kept by the store through a
    /// lowered limit, only runs down).
    fn usable_while_held(&self) -> u64 {
        match self.call {
            Some(call) => self.admits.min(call.want),
            None => self.admits,
        }
    }

    /// Sets what the store holds for this host (and so what of it may admit).
    fn set_held(&mut self, held: u64) {
        self.held = held;
        self.admits = held.min(self.room);
    }

    /// Takes a free slot if there is one and no earlier request waits for one, else one on
    /// credit if the key has some left. The time is asked only whether the holding is still
    /// valid or the store still left alone, so a recent reading answers (see [`Now`]).
    pub(crate) fn try_take(&mut self, now: &mut Now<impl FnMut() -> u64>) -> TryTake {
        if self.waiters.is_empty()
            && self.in_use < self.usable_while_held()
            && now.is_before(self.usable_until)
        {
            self.take_one();
            return TryTake::Taken;
        }
        self.take_beyond_holding(now)
    }

    /// No free slot on the holding: the failure policy decides while the store is left
    /// alone, else the credit, else the request must wait. Kept off the hot path.
    #[cold]
    fn take_beyond_holding(&mut self, now: &mut Now<impl FnMut() -> u64>) -> TryTake {
        if now.is_before(self.down_until) {
            let admitted = self.in_use < self.fallback_cap;
            if admitted {
                self.take_one();
            }
            return TryTake::Fallback { admitted };
        }
        if self.credit_covers(now) {
            self.take_one();
            return TryTake::OnCredit;
        }
        TryTake::MustWait
    }

    /// Whether one more request may go in flight on credit: the key is not known to be full,
    /// no earlier request waits, fewer than `credit` run beyond what the holding covers, and
    /// fewer than the last answer left this host (credit past it would run over the limit for
    /// certain: a key this host has seen nearly full waits for the store instead).
    fn credit_covers(&self, now: &mut Now<impl FnMut() -> u64>) -> bool {
        if self.credit == 0 || self.full || !self.waiters.is_empty() {
            return false;
        }
        let covered = match now.is_before(self.usable_until) {
            true => self.usable_while_held(),
            false => 0,
        };
        self.in_use < covered.saturating_add(self.credit).min(self.room)
    }

    /// A request was admitted on credit at `now`: the call that asks the store to hold what
    /// is in flight, when none is out (the answer to the one out asks again if it held less).
    pub(crate) fn ask(&mut self, now: u64, seq: impl FnOnce() -> u64) -> Option<SlotCall> {
        self.start_call(self.wanted(), now, seq)
    }

    /// The holding to ask for: a slot for each request in flight and each waiting, but, while
    /// this host holds more than it may use (past the room the store's last answer left it,
    /// after a lowered limit), none beyond what it may use. The store keeps what a host holds
    /// up to what it asks for, so a host that asked for its waiters would keep slots that
    /// admit nothing: every host with requests waiting would keep one, and none admit.
    fn wanted(&self) -> u64 {
        let needed = self.in_use + self.waiters.len() as u64;
        let usable = self.in_use.max(self.room);
        match self.held > usable {
            true => needed.min(usable),
            false => needed,
        }
    }

    fn take_one(&mut self) {
        self.in_use += 1;
        self.peak = self.peak.max(self.in_use);
    }

    /// Queues `waiter`, come at `now`, for the store's answer; returns the call to make when
    /// none is out.
    pub(crate) fn wait(
        &mut self,
        waiter: W,
        now: u64,
        seq: impl FnOnce() -> u64,
    ) -> Option<SlotCall> {
        self.waiters.push_back((waiter, now));
        self.start_call(self.wanted(), now, seq)
    }

    fn start_call(&mut self, want: u64, now: u64, seq: impl FnOnce() -> u64) -> Option<SlotCall> {
        if self.call.is_some() {
            return None;
        }
        let call = SlotCall {
            seq: seq(),
            want,
            sent_at: now,
        };
        self.call = Some(call);
        Some(call)
    }

    /// A request ended: its slot goes to the first waiter, if one can use it, which is then
    /// returned (it holds the slot).
    /// The clock is read (`now`) only when a request waits.
    pub(crate) fn release(&mut self, now: impl FnOnce() -> u64) -> Option<W> {
        self.in_use = self.in_use.saturating_sub(1);
        if !self.waiters.is_empty()
            && self.in_use < self.usable(now())
            && let Some((waiter, _)) = self.waiters.pop_front()
        {
            self.take_one();
            return Some(waiter);
        }
        None
    }

    /// The store answered call `seq`: it holds `granted` slots for this host, usable until
    /// `usable_until`.
    pub(crate) fn answered(
        &mut self,
        seq: u64,
        granted: u64,
        usable_until: u64,
        now: u64,
        next_seq: impl FnOnce() -> u64,
    ) -> Decided<W> {
        let Some(call) = self.call.take_if(|call| call.seq == seq) else {
            return Decided::default();
        };
        self.set_held(granted);
        self.usable_until = usable_until;
        self.down_until = 0;
        self.uncertain = false;
        let mut decided = Decided::default();
        while self.in_use < self.usable(now) {
            let Some((waiter, _)) = self.waiters.pop_front() else {
                break;
            };
            self.take_one();
            decided.admitted.push(waiter);
        }
        // The fleet was full: the store held less than asked, or no more than the room left.
        let short = self.admits < call.want;
        if short && self.patient {
            // The waiters stay, and the sweep asks again.
            return decided;
        }
        if short {
            // The fleet was full when the call was served: those who came before it was sent
            // saw it full while they waited.
            while let Some((_, came)) = self.waiters.front() {
                if *came > call.sent_at {
                    break;
                }
                if let Some((waiter, _)) = self.waiters.pop_front() {
                    decided.full.push(waiter);
                }
            }
        }
        // Waiters, or requests admitted on credit while a call for fewer was out (and the
        // store, not full, held what it was asked): the store is asked to hold them all.
        let beyond_holding = !short && self.in_use > granted;
        if !self.waiters.is_empty() || beyond_holding {
            decided.next = self.start_call(self.wanted(), now, next_seq);
        }
        decided
    }

    /// Call `seq` failed or timed out; the store is left alone until `retry_at`. Whether it
    /// was applied is unknown, so the host counts on the smaller of the two holdings. The
    /// waiters are decided by the failure policy's cap.
    pub(crate) fn failed(&mut self, seq: u64, retry_at: u64) -> Decided<W> {
        let Some(call) = self.call.take_if(|call| call.seq == seq) else {
            return Decided::default();
        };
        self.set_held(self.held.min(call.want));
        self.down_until = retry_at;
        self.uncertain = true;
        let mut decided = Decided::default();
        for (waiter, _) in std::mem::take(&mut self.waiters) {
            if self.in_use < self.fallback_cap {
                self.take_one();
                decided.admitted.push(waiter);
            } else {
                decided.unavailable.push(waiter);
            }
        }
        decided
    }

    /// The sweep's call for this key, if it needs one: slots beyond the most in flight over
    /// this pass and the one before are given back; a holding (or requests in flight) whose
    /// time ends before `renew_by` is renewed.
    pub(crate) fn sweep(
        &mut self,
        now: u64,
        renew_by: u64,
        seq: impl FnOnce() -> u64,
    ) -> Option<SlotCall> {
        let keep = self.peak.max(self.last_peak).max(self.in_use);
        self.last_peak = self.peak;
        self.peak = self.in_use;
        // Not held back by a failure's back-off: a holding left unrenewed would expire under
        // the requests running on it.
        if self.call.is_some() {
            return None;
        }
        if !self.waiters.is_empty() && now >= self.down_until {
            // Patient requests still waiting for a slot another host may have freed.
            return self.start_call(self.wanted(), now, seq);
        }
        if self.held > keep {
            return self.start_call(keep, now, seq);
        }
        let holds = self.held > 0 || self.in_use > 0;
        // After a failure, once the back-off is over, the holding is set again even if
        // nothing is held: a call the store applied late must not strand slots until it
        // expires.
        let reconcile = self.uncertain && now >= self.down_until;
        if (holds && self.usable_until < renew_by) || reconcile {
            return self.start_call(self.held.max(self.in_use), now, seq);
        }
        None
    }

    /// The call that gives back every slot held beyond those in use, for a host about to
    /// stop: none while a call is out (its answer may change the holding).
    pub(crate) fn give_back_unused(
        &mut self,
        now: u64,
        seq: impl FnOnce() -> u64,
    ) -> Option<SlotCall> {
        if self.held <= self.in_use {
            return None;
        }
        self.start_call(self.in_use, now, seq)
    }

    /// Forgets the waiters that have gone (their requests ended while they waited).
    pub(crate) fn forget_gone(&mut self, gone: impl Fn(&W) -> bool) {
        self.waiters.retain(|(waiter, _)| !gone(waiter));
    }

    /// Nothing in use, held, asked for or awaited, and nothing left uncertain at the store:
    /// the key can be forgotten.
    pub(crate) fn is_idle(&self) -> bool {
        self.in_use == 0
            && self.held == 0
            && self.call.is_none()
            && self.waiters.is_empty()
            && !self.uncertain
    }
}

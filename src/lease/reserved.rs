//! Tokens reserved ahead of the global refill, in tranches.

/// Tokens reserved ahead of the global refill, in tranches by when each falls due (clock
/// micros), earliest first: a later reservation never delays an earlier one, so tokens
/// reserved while the store is slower than a token interval are used as each falls due.
pub(super) struct Reserved {
    // Behind one thin pointer: the state stays in its allocation class, and tranches are
    // added and released once per batch at most. `None` when none is reserved or lapsed.
    tranches: Option<Box<Tranches>>,
}

struct Tranches {
    due: Vec<(u64, u64)>,
    /// Tokens that fell due into a full lease, not counted yet (see [`Reserved::lapse`]).
    lapsed: u64,
}

/// Tranches kept apart; beyond, the latest two merge (the later due wins, so nothing is used
/// early).
const MAX_TRANCHES: usize = 8;

impl Reserved {
    pub(super) const NONE: Self = Self { tranches: None };

    pub(super) fn all(&self) -> &[(u64, u64)] {
        self.tranches.as_deref().map_or(&[], |t| t.due.as_slice())
    }

    pub(super) fn set(&mut self, due: Vec<(u64, u64)>) {
        let lapsed = self.lapsed();
        self.tranches = (!due.is_empty() || lapsed > 0).then(|| Box::new(Tranches { due, lapsed }));
    }

    /// Whether no tranche is still to fall due.
    pub(super) fn is_empty(&self) -> bool {
        self.all().is_empty()
    }

    /// Tokens that fell due into a full lease and are not counted yet.
    pub(super) fn lapsed(&self) -> u64 {
        self.tranches.as_deref().map_or(0, |t| t.lapsed)
    }

    /// `tokens` fell due into a lease that held its capacity: they lapse, as a refill into a
    /// full bucket does (kept, a burst could spend more than the capacity in one instant),
    /// and are counted as forfeited when [taken](Self::take_lapsed).
    pub(super) fn lapse(&mut self, tokens: u64) {
        if tokens == 0 {
            return;
        }
        match self.tranches.as_deref_mut() {
            Some(tranches) => tranches.lapsed = tranches.lapsed.saturating_add(tokens),
            None => {
                self.tranches = Some(Box::new(Tranches {
                    due: Vec::new(),
                    lapsed: tokens,
                }));
            }
        }
    }

    /// Takes out the count of lapsed tokens, to be counted.
    pub(super) fn take_lapsed(&mut self) -> u64 {
        let Some(tranches) = self.tranches.as_deref_mut() else {
            return 0;
        };
        let lapsed = std::mem::take(&mut tranches.lapsed);
        if tranches.due.is_empty() {
            self.tranches = None;
        }
        lapsed
    }

    pub(super) fn total(&self) -> u64 {
        self.all()
            .iter()
            .fold(0u64, |sum, &(_, tokens)| sum.saturating_add(tokens))
    }

    /// When the last tranche falls due (0 when none is reserved).
    pub(super) fn last_due(&self) -> u64 {
        self.all().last().map_or(0, |&(due, _)| due)
    }

    pub(super) fn add(&mut self, due: u64, tokens: u64) {
        let mut tranches = self.all().to_vec();
        let at = tranches.partition_point(|&(d, _)| d <= due);
        match at.checked_sub(1).map(|i| &mut tranches[i]) {
            Some((d, held)) if *d == due => *held = held.saturating_add(tokens),
            _ => tranches.insert(at, (due, tokens)),
        }
        if tranches.len() > MAX_TRANCHES
            && let Some((due, tokens)) = tranches.pop()
            && let Some(last) = tranches.last_mut()
        {
            *last = (due, last.1.saturating_add(tokens));
        }
        self.set(tranches);
    }

    /// Brings each tranche due no later than `accrue` (micros to refill tokens) says the
    /// tranches up to it refill from `now`: for tokens reserved under a limit since raised.
    pub(super) fn hasten(&mut self, now: u64, accrue: impl Fn(u64) -> u64) {
        let mut reserved = 0u64;
        let tranches = (self.all().iter())
            .map(|&(due, tokens)| {
                reserved = reserved.saturating_add(tokens);
                (due.min(now.saturating_add(accrue(reserved))), tokens)
            })
            .collect();
        self.set(tranches);
    }

    /// Tokens due by `now`, without taking them.
    pub(super) fn due_by(&self, now: u64) -> u64 {
        self.all()
            .iter()
            .take_while(|&&(due, _)| due <= now)
            .fold(0u64, |sum, &(_, tokens)| sum.saturating_add(tokens))
    }

    /// Takes out the tranches due by `now`: their tokens, and when the last of them fell due.
    pub(super) fn take_due(&mut self, now: u64) -> (u64, u64) {
        let n = self.all().partition_point(|&(due, _)| due <= now);
        if n == 0 {
            return (0, 0);
        }
        let taken = self.all()[..n]
            .iter()
            .fold((0u64, 0), |(sum, _), &(due, tokens)| {
                (sum.saturating_add(tokens), due)
            });
        let rest = self.all()[n..].to_vec();
        self.set(rest);
        taken
    }

    /// When the tranches hold `tokens` in all (the last one's due when they never do).
    pub(super) fn covering(&self, tokens: u64) -> u64 {
        let mut sum = 0u64;
        for &(due, held) in self.all() {
            sum = sum.saturating_add(held);
            if sum >= tokens {
                return due;
            }
        }
        self.last_due()
    }

    /// Takes out every tranche (what lapsed stays, to be counted).
    pub(super) fn take_all(&mut self) -> u64 {
        let all = self.total();
        self.set(Vec::new());
        all
    }
}

//! Windows that start later: one host serves its keys slowly or busily, goes quiet for a while,
//! then a burst comes (the herd), and the oracle checks every window of the run, not only those
//! from its start. A host holds leased tokens while the global bucket refills around them; its
//! fetches take that refill back, so with one host every window `[a, b]` stays within
//! `capacity + rate x (b - a)`, plus what the store's latency shifts (a token refilled at the
//! store is admitted up to one answer later) and the credit a host may give before its store
//! answers. Several hosts at once can spend what each held on top of the refilled bucket (the
//! README's "windows that start later"): this draws one host.
//!
//! A seed's windowed scenario is its own scenario narrowed to what the property holds for: one
//! host, a store that answers (slowly or not), no change of limit, by hand or at a calendar
//! reset, no settled costs, no limit that warms up, no reservation held for later; its
//! traffic gets a quiet stretch before the herd, drawn from a stream of its own.

use std::collections::HashMap;
use std::time::Duration;

use hierarchical_throttle::Limit;

use super::{Admission, FaultPlan, Quotas, Rng, Scenario};

impl Scenario {
    /// Seed `seed`'s scenario, narrowed for the windowed check.
    pub fn draw_windows(seed: u64) -> Self {
        let mut s = Self::draw(seed);
        let mut rng = Rng::new(seed ^ 0x0057_1D0E);
        s.hosts = 1;
        // The counters still read, on the one host.
        for (_, host) in &mut s.counter_reads {
            *host = 0;
        }
        s.faulty = false;
        s.faults = FaultPlan {
            // Within the time-out: a faulty seed's draw may be twice it.
            latency_max: s.faults.latency_max.min(Duration::from_millis(45)),
            partial: s.faults.partial,
            ..FaultPlan::default()
        };
        s.policy = hierarchical_throttle::FailurePolicy::Reject;
        s.change = None;
        s.tenant_change = None;
        s.tenants = None;
        s.settle = false;
        s.huge_one_in = 0;
        s.adjustments.clear();
        s.calendar = false;
        s.calendar_zone = None;
        s.unix_origin = Duration::ZERO;
        s.reserve_one_in = 0;
        s.park_one_in = 0;
        s.meter_one_in = 0;
        s.shadow = false;
        s.shadow_slow = false;
        s.stops.clear();
        s.stop_at_end = None;
        // The host's clock exact: a coarse one shifts its estimate of the refill.
        s.tick = Duration::ZERO;
        for key in &mut s.keys {
            key.limit = without_warm_up(key.limit);
            key.load_tenths = [1, 3, 5, 9, 11, 20][rng.below(6) as usize];
        }
        // Traffic for a while, a quiet stretch (shorter than a lease's time-to-live, or
        // several), a burst, and traffic after it.
        let ttl = s.lease_ttl.as_micros() as u64;
        s.quiet = Duration::from_micros(ttl * [3, 8, 15, 30][rng.below(4) as usize] / 10);
        s.herd_at = Duration::from_millis(rng.range(500, 2_000)) + s.quiet;
        s.herd = [10, 100, 300, 2_000][rng.below(4) as usize];
        s.duration = s.herd_at + Duration::from_millis(rng.range(100, 1_500));
        if !s.counter_reads.is_empty() {
            // Also just before the burst, when buckets evicted in the quiet stretch (by the
            // spray) may hold tokens the global bucket refilled around.
            s.counter_reads
                .push((s.herd_at.saturating_sub(Duration::from_millis(1)), 0));
            s.counter_reads.sort_by_key(|(at, _)| *at);
        }
        s.windows = true;
        s
    }
}

/// `limit` at the same rate and burst, without a warm-up.
fn without_warm_up(limit: Limit) -> Limit {
    Limit::per(limit.refill_amount(), limit.refill_period())
        .burst(limit.capacity())
        .expect("a valid limit")
}

/// For every bucket of every key, every window of the run between two admissions: the tokens
/// used in it within `capacity + rate x (length + the store's latency)`, plus the credit one
/// host may give and `unrecorded` (tokens admitted without a lease).
pub fn check(
    s: &Scenario,
    quotas: &Quotas,
    admitted: &[&Admission],
    unrecorded: u64,
) -> Result<(), String> {
    let quotas = quotas.lock().unwrap();
    let mut per_key: HashMap<&str, Vec<&Admission>> = HashMap::new();
    for a in admitted {
        per_key.entry(&a.key).or_default().push(a);
    }
    for (key, mut events) in per_key {
        events.sort_by_key(|a| a.at);
        for (name, limit) in quotas[key].iter() {
            if s.shadow_slow && name == "slow" {
                continue;
            }
            let slack = s.cold_start.credit(limit).saturating_add(unrecorded);
            check_bucket(limit, &events, s.faults.latency_max, slack)
                .map_err(|e| format!("over-admission in a window: {key}/{name}: {e}"))?;
        }
    }
    Ok(())
}

/// The windowed bound for one bucket's admissions, in arrival order. In units of a token times
/// the limit's refill period in micros, so that the rate is exact: the window from admission
/// `i` to admission `j` used `used[i..=j]`, allowed `capacity + slack + 1` (whole tokens of a
/// refill rounded down at each end) and `amount x (at_j - at_i + latency)`.
fn check_bucket(
    limit: &Limit,
    events: &[&Admission],
    latency: Duration,
    slack: u64,
) -> Result<(), String> {
    let period = limit.refill_period().as_micros() as i128;
    let amount = i128::from(limit.refill_amount());
    let fixed = (i128::from(limit.capacity()) + i128::from(slack) + 1) * period
        + amount * latency.as_micros() as i128;
    // The largest `amount x at_i - period x used before i` over the windows' starts so far.
    let mut best_start = i128::MIN;
    let mut best_at = Duration::ZERO;
    let mut used_before = 0i128;
    for a in events {
        let start = amount * a.at.as_micros() as i128 - period * used_before;
        if start > best_start {
            (best_start, best_at) = (start, a.at);
        }
        used_before += i128::from(a.used);
        let over = period * used_before - amount * a.at.as_micros() as i128 + best_start - fixed;
        if over > 0 {
            return Err(format!(
                "the window from {best_at:?} to {:?} used {} tokens more than {} (capacity {}, \
                 {} per {:?}, latency {latency:?}, slack {slack})",
                a.at,
                over as f64 / period as f64,
                fixed as f64 / period as f64,
                limit.capacity(),
                limit.refill_amount(),
                limit.refill_period(),
            ));
        }
    }
    Ok(())
}

/// Runs seed `seed`'s windowed scenario.
pub fn run(seed: u64) -> Result<String, String> {
    super::run_scenario(Scenario::draw_windows(seed))
}

//! Auto-converge: when the guest dirties memory faster than the migration
//! sends it, make its vCPU sleep a growing share of the time, as QEMU's
//! `auto-converge` does (same thresholds: throttle once the bytes dirtied
//! during an iteration exceed half the bytes sent, counted twice; start at
//! 20 %, add 10 % each time after, at most 99 %).

/// The first throttle.
const INITIAL: f64 = 0.2;
/// Added each time the guest still dirties too fast.
const INCREMENT: f64 = 0.1;
/// The most.
const MAX: f64 = 0.99;
/// Dirtied / sent above this counts as dirtying too fast.
const THRESHOLD: f64 = 0.5;
/// Too-fast iterations needed before each step.
const STRIKES: u32 = 2;

/// The throttle's state through one migration.
#[derive(Debug, Default, Clone)]
pub struct AutoConverge {
    strikes: u32,
    /// Share of time the guest sleeps now.
    pub fraction: f64,
}

impl AutoConverge {
    /// After an iteration that sent `sent` bytes while the guest dirtied
    /// `dirtied` bytes' worth of pages: the new throttle, if it changes.
    pub fn after_iteration(&mut self, dirtied: f64, sent: f64) -> Option<f64> {
        if dirtied <= THRESHOLD * sent {
            return None;
        }
        self.strikes += 1;
        if self.strikes < STRIKES {
            return None;
        }
        self.strikes = 0;
        // Whole percents, so stats read 0.3, not 0.30000000000000004.
        let next = if self.fraction == 0.0 { INITIAL } else { ((self.fraction + INCREMENT) * 100.0).round() / 100.0 };
        let next = next.min(MAX);
        (next != self.fraction).then(|| {
            self.fraction = next;
            next
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttles_after_two_fast_iterations_then_steps_up_to_99_percent() {
        let mut a = AutoConverge::default();
        assert_eq!(a.after_iteration(10.0, 100.0), None, "slow dirtying never throttles");
        assert_eq!(a.after_iteration(60.0, 100.0), None, "one strike is not enough");
        assert_eq!(a.after_iteration(60.0, 100.0), Some(0.2));
        assert_eq!(a.after_iteration(90.0, 100.0), None);
        let next = a.after_iteration(90.0, 100.0).unwrap();
        assert!((next - 0.3).abs() < 1e-9);
        for _ in 0..40 {
            a.after_iteration(90.0, 100.0);
        }
        assert_eq!(a.fraction, 0.99);
        assert_eq!(a.after_iteration(90.0, 100.0), None);
        assert_eq!(a.after_iteration(90.0, 100.0), None, "at the most, nothing changes");
    }
}

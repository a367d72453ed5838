//! When pre-copy stops iterating (Clark et al.; the limits of Xen and
//! QEMU): once what is left should go out within the downtime limit, or
//! after the iteration limit, or once three times memory went out. Also
//! when auto-converge slows the guest.

use std::time::Duration;

use tsubame_trace::auto_converge::AutoConverge;
use tsubame_vmm::PAGE_SIZE;

use crate::options::MigrateOptions;
use crate::protocol::pages::RECORD_HEADER;
use crate::stats::{IterationStats, StopReason};

/// What the policy learned from the iterations so far.
pub struct PrecopyPolicy {
    /// Measured link bandwidth, bytes per second (capped by the option).
    bandwidth: f64,
    /// Bytes on the wire per dirty page, from the iterations after the first.
    bytes_per_page: f64,
    /// The guest's throttle, when `auto_converge` is on.
    pub auto_converge: AutoConverge,
}

/// What to do after an iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Iterate again; throttle the guest to this share if Some.
    Continue {
        /// A new throttle for the guest.
        throttle: Option<f64>,
    },
    /// Stop iterating, for this reason.
    Stop(StopReason),
}

impl Default for PrecopyPolicy {
    fn default() -> Self {
        PrecopyPolicy {
            bandwidth: 0.0,
            bytes_per_page: (PAGE_SIZE + RECORD_HEADER) as f64,
            auto_converge: AutoConverge::default(),
        }
    }
}

impl PrecopyPolicy {
    /// Learns from an iteration just sent; returns the bandwidth to assume
    /// from now on (bytes per second).
    pub fn observe(&mut self, it: &IterationStats, options: &MigrateOptions) -> f64 {
        // Iteration 0 also carries never-touched memory (cheap zero
        // records), which says nothing about what the guest dirties:
        // estimate later rounds from later rounds only.
        if it.index > 0 && it.pages_sent > 0 {
            self.bytes_per_page = it.bytes_on_wire as f64 / it.pages_sent as f64;
        }
        if it.duration_ms > 1.0 {
            self.bandwidth = it.bytes_on_wire as f64 / (it.duration_ms / 1e3);
        }
        self.bandwidth_for(options)
    }

    /// How long sending `pages` dirty pages should take.
    pub fn expected(&self, pages: u64, bandwidth: f64) -> Duration {
        Duration::from_secs_f64(pages as f64 * self.bytes_per_page / bandwidth)
    }

    /// Decides after iteration `it` (already observed), with `remaining`
    /// pages dirty now, `iterations` done and `sent` bytes on the wire in
    /// all for a VM of `memory_bytes`.
    pub fn decide(
        &mut self,
        it: &IterationStats,
        remaining: u64,
        iterations: u32,
        sent: u64,
        memory_bytes: u64,
        options: &MigrateOptions,
    ) -> Decision {
        let expected = self.expected(remaining, self.bandwidth_for(options));
        let stop = if remaining == 0 {
            Some(StopReason::NoDirtyPages)
        } else if expected <= options.downtime_limit {
            Some(StopReason::Converged)
        } else if iterations >= options.max_iterations {
            Some(StopReason::MaxIterations)
        } else if sent > 3 * memory_bytes {
            Some(StopReason::Sent3xMemory)
        } else {
            None
        };
        if let Some(reason) = stop {
            return Decision::Stop(reason);
        }
        let mut throttle = None;
        if options.auto_converge && it.index > 0 {
            let dirtied = remaining as f64 * self.bytes_per_page;
            throttle = self.auto_converge.after_iteration(dirtied, it.bytes_on_wire as f64);
        }
        Decision::Continue { throttle }
    }

    /// The measured bandwidth, capped by `--max-bandwidth`.
    pub fn bandwidth_for(&self, options: &MigrateOptions) -> f64 {
        options.max_bandwidth.map_or(self.bandwidth, |cap| self.bandwidth.min(cap as f64)).max(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iteration(index: u32, pages: u64, bytes: u64, ms: f64) -> IterationStats {
        IterationStats {
            index,
            dirty_pages: pages,
            pages_sent: pages,
            bytes_on_wire: bytes,
            duration_ms: ms,
            throttle: 0.0,
        }
    }

    #[test]
    fn stops_when_the_rest_fits_the_limit() {
        let options = MigrateOptions::default(); // 300 ms
        let mut policy = PrecopyPolicy::default();
        // 100 MB/s, 4109 bytes per page: 300 ms carry ~7300 pages.
        let first = iteration(1, 10_000, 41_090_000, 410.9);
        policy.observe(&first, &options);
        assert_eq!(policy.decide(&first, 0, 2, 0, 1 << 30, &options), Decision::Stop(StopReason::NoDirtyPages));
        assert_eq!(policy.decide(&first, 7000, 2, 0, 1 << 30, &options), Decision::Stop(StopReason::Converged));
        assert_eq!(policy.decide(&first, 8000, 2, 0, 1 << 30, &options), Decision::Continue { throttle: None });
        assert_eq!(policy.decide(&first, 8000, 30, 0, 1 << 30, &options), Decision::Stop(StopReason::MaxIterations));
        assert_eq!(
            policy.decide(&first, 8000, 2, 4 << 30, 1 << 30, &options),
            Decision::Stop(StopReason::Sent3xMemory)
        );
    }
}

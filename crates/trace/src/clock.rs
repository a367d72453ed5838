//! The replay's clock: where each interval of a trace sits in the guest's
//! own time, and whether that time can be trusted.

use crate::format::Trace;

/// The fewest values the guest's ops counter must show while traced (its
/// first and two rises) for the trace to be placed on the guest's own
/// time: with fewer, no stretch of work lies between two measured points.
/// A small share of work is no reason to leave the work clock: a 1 GiB
/// `sparse` guest works 0.2 % of its traced time (about one 8-byte store
/// per write-protect fault), and its work clock predicted a real
/// migration better than wall time did.
pub const MIN_COUNTER_STEPS: usize = 3;

/// What a replay's clock rests on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ClockBasis {
    /// The guest's work: its ops counter over its speed before tracing.
    GuestWork,
    /// Wall time: the trace has no ops counter (version 1).
    WallNoOps,
    /// Wall time: the guest's counter showed fewer than
    /// [`MIN_COUNTER_STEPS`] values (`work_s` seconds of work in
    /// `traced_s` traced); it barely ran between faults.
    WallBarelyRan {
        /// Seconds of undisturbed work the counter measured.
        work_s: f64,
        /// Wall seconds they were measured over.
        traced_s: f64,
    },
}

/// The trace on the guest's own clock: each interval's position in
/// seconds of undisturbed guest work, and what a write-protect fault
/// costs the guest in wall time.
///
/// Dirty logging slows a guest: every first write to a protected page
/// faults (expensive under PVM, where ring 0 is emulated), and a tracer
/// re-protects every page each tick, a migration only once per iteration.
/// So the trace is replayed by guest work, not wall time: from the ops
/// counter recorded with each interval and the guest's speed before
/// recording, `work` places each interval, and the wall time the tracer
/// cost beyond that work, divided by the faults it caused (one per
/// recorded change), gives `fault_s`. A migration's iteration of T wall
/// seconds then lets the guest do Δw of work where
/// `Δw / guest_speed + fault_s × (pages first-written in Δw) = T`.
/// Traces without ops (version 1), and those whose guest barely ran
/// ([`MIN_COUNTER_STEPS`]), replay on wall time with no fault cost.
#[derive(Debug, Clone)]
pub struct GuestClock {
    /// Work-seconds at each interval's end, ascending.
    pub work: Vec<f64>,
    /// Work-seconds of one pass over the trace.
    pub span: f64,
    /// Wall seconds one fault costs the guest.
    pub fault_s: f64,
    /// The interval a replay goes on from after the trace's end: the first
    /// past half its work. Its start is the tracer's warm-up (the writes
    /// of the first pass, every page faulting once, 2 MiB pieces being
    /// split), which a migration already running does not see again.
    pub loop_from: usize,
    /// Guest work or wall time, and why.
    pub basis: ClockBasis,
}

impl GuestClock {
    /// The clock of `trace`.
    pub fn of(trace: &Trace) -> GuestClock {
        let wall: Vec<f64> = trace.intervals.iter().map(|i| i.at_us as f64 / 1e6).collect();
        if !trace.has_guest_ops() {
            return GuestClock::wall(wall, ClockBasis::WallNoOps);
        }
        let native = trace.setup.native_ops_per_sec as f64;
        // The counter moves in steps (a progress line every ~50 ms of guest
        // work): place each step at the first tick that saw it and
        // interpolate between steps.
        let mut steps: Vec<(f64, f64)> = vec![(wall[0], trace.intervals[0].ops as f64)];
        for (i, interval) in trace.intervals.iter().enumerate() {
            if interval.ops as f64 > steps.last().unwrap().1 {
                steps.push((wall[i], interval.ops as f64));
            }
        }
        let ops_at = |t: f64| -> f64 {
            let k = steps.partition_point(|&(at, _)| at <= t);
            if k == 0 {
                return steps[0].1;
            }
            if k == steps.len() {
                return steps[k - 1].1;
            }
            let ((t0, o0), (t1, o1)) = (steps[k - 1], steps[k]);
            o0 + (o1 - o0) * (t - t0) / (t1 - t0)
        };
        let base = steps[0].1;
        let work: Vec<f64> = wall.iter().map(|&t| (ops_at(t) - base) / native).collect();
        let span = *work.last().unwrap();
        // Wall time until the last step, less the work done in it, is what
        // the faults (and the tracer's work per fault) cost the guest.
        // Interval 0 (the tracer's first pass) is outside the work clock.
        let last_step = steps.last().unwrap().0;
        let wall_span = last_step - wall[0];
        if !work_clock_usable(steps.len(), span) {
            return GuestClock::wall(wall, ClockBasis::WallBarelyRan { work_s: span, traced_s: wall_span });
        }
        let faults: usize = trace
            .intervals
            .iter()
            .zip(&wall)
            .skip(1)
            .filter(|(_, &t)| t <= last_step)
            .map(|(i, _)| i.changes.len())
            .sum();
        let fault_s = if faults > 0 { ((wall_span - span) / faults as f64).max(0.0) } else { 0.0 };
        let loop_from = loop_from(&work, span);
        GuestClock { work, span, fault_s, loop_from, basis: ClockBasis::GuestWork }
    }

    /// The clock that is wall time itself: the tracer's pace, faults and
    /// all, so no fault cost on top.
    fn wall(wall: Vec<f64>, basis: ClockBasis) -> GuestClock {
        let span = wall.last().zip(wall.first()).map_or(0.0, |(l, f)| l - f);
        let loop_from = loop_from(&wall, span);
        GuestClock { work: wall, span, fault_s: 0.0, loop_from, basis }
    }
}

/// Whether a counter that showed `steps` values and measured `work_s`
/// seconds of work makes a clock.
pub fn work_clock_usable(steps: usize, work_s: f64) -> bool {
    steps >= MIN_COUNTER_STEPS && work_s > 0.0
}

/// The first interval (never 0) whose work is past half of `span`; 1
/// when the part after it holds no work (a lap must move the clock).
fn loop_from(work: &[f64], span: f64) -> usize {
    let (Some(&first), Some(&last)) = (work.first(), work.last()) else {
        return 1;
    };
    let half = first + span / 2.0;
    match work.iter().position(|&w| w > half) {
        Some(i) if i >= 1 && last > work[i - 1] => i,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Interval, PageChange, Setup};

    /// 10 s of 10 ms ticks, each writing 100 pages, while the guest's
    /// counter (1M ops/s undisturbed, one step every 50 ms) does
    /// `share` of its undisturbed work.
    fn trace_working(share: f64) -> Trace {
        let setup = Setup {
            memory_bytes: 64 << 20,
            granularity: 128,
            interval_us: 10_000,
            workload: "t".into(),
            native_ops_per_sec: 1_000_000,
            huge_pages: false,
        };
        let change = |page| PageChange { page, mask: 1, xbzrle_bytes: 10, zero: false };
        let intervals = (1..=1000u64)
            .map(|i| Interval {
                at_us: i * 10_000,
                ops: ((i / 5 * 5) as f64 * 10_000.0 * share) as u64,
                changes: (0..100).map(|p| change(p * 100 + i % 100)).collect(),
            })
            .collect();
        Trace { setup, nonzero: vec![u64::MAX; 256], intervals }
    }

    #[test]
    fn a_guest_that_worked_is_replayed_by_its_work() {
        for share in [0.03, 0.4, 1.0] {
            let clock = GuestClock::of(&trace_working(share));
            assert_eq!(clock.basis, ClockBasis::GuestWork, "{share}");
            assert!((clock.span - 10.0 * share).abs() < 1e-9, "{share}: {}", clock.span);
            // The rest of the 9.99 s between the first and last steps went
            // to the 99 900 faults recorded after the first tick.
            let fault_s = ((9.99 - 10.0 * share) / 99_900.0).max(0.0);
            assert!((clock.fault_s - fault_s).abs() < 1e-12, "{share}: {}", clock.fault_s);
        }
    }

    #[test]
    fn a_guest_that_barely_ran_is_replayed_on_wall_time() {
        // The counter rose once, at the end: no stretch of work between
        // two measured points.
        let mut trace = trace_working(1.0);
        for interval in &mut trace.intervals {
            interval.ops = 0;
        }
        trace.intervals.last_mut().unwrap().ops = 20_000;
        let clock = GuestClock::of(&trace);
        match clock.basis {
            ClockBasis::WallBarelyRan { work_s, traced_s } => {
                assert!((work_s - 0.02).abs() < 1e-9, "{work_s}");
                assert!((traced_s - 9.99).abs() < 1e-9, "{traced_s}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(clock.fault_s, 0.0, "wall time already holds the faults");
        assert!((clock.span - 9.99).abs() < 1e-9);
        assert_eq!(clock.work[0], 0.01);
        assert_eq!(clock.loop_from, 500);
    }

    #[test]
    fn a_small_share_of_work_still_makes_a_clock() {
        // A sparse guest under the tracer: 0.2 % of its time working.
        let clock = GuestClock::of(&trace_working(0.002));
        assert_eq!(clock.basis, ClockBasis::GuestWork);
        assert!((clock.span - 0.02).abs() < 1e-9, "{}", clock.span);
    }

    #[test]
    fn the_line_is_the_counters_steps() {
        assert!(work_clock_usable(3, 0.1));
        assert!(work_clock_usable(200, 0.001));
        assert!(!work_clock_usable(2, 5.0));
        assert!(!work_clock_usable(3, 0.0), "no work is no clock");
    }

    #[test]
    fn a_trace_without_ops_is_on_wall_time() {
        let mut trace = trace_working(1.0);
        trace.setup.native_ops_per_sec = 0;
        let clock = GuestClock::of(&trace);
        assert_eq!(clock.basis, ClockBasis::WallNoOps);
        assert_eq!((clock.fault_s, clock.loop_from), (0.0, 500));
    }
}

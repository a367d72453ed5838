//! The replay's clock: where each interval of a trace sits in the guest's
//! own time.

use crate::format::Trace;

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
/// Traces without ops (version 1) replay on wall time with no fault cost.
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
}

impl GuestClock {
    /// The clock of `trace`.
    pub fn of(trace: &Trace) -> GuestClock {
        let wall: Vec<f64> = trace.intervals.iter().map(|i| i.at_us as f64 / 1e6).collect();
        if !trace.has_guest_ops() {
            return GuestClock::wall(wall);
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
        let faults: usize = trace
            .intervals
            .iter()
            .zip(&wall)
            .skip(1)
            .filter(|(_, &t)| t <= last_step)
            .map(|(i, _)| i.changes.len())
            .sum();
        let wall_span = last_step - wall[0];
        let fault_s = if faults > 0 { ((wall_span - span) / faults as f64).max(0.0) } else { 0.0 };
        let loop_from = loop_from(&work, span);
        GuestClock { work, span, fault_s, loop_from }
    }

    /// The clock that is wall time itself: the tracer's pace, faults and
    /// all, so no fault cost on top.
    fn wall(wall: Vec<f64>) -> GuestClock {
        let span = wall.last().zip(wall.first()).map_or(0.0, |(l, f)| l - f);
        let loop_from = loop_from(&wall, span);
        GuestClock { work: wall, span, fault_s: 0.0, loop_from }
    }
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

//! The RDMA paper's dirty-page model (§6.3.2–6.3.4): a workload that
//! rewrites M pages at random dirties D(t) = M − M·(1/2)^(t(1−β)/τ)
//! distinct pages in t seconds (β: the share of CPU the migration takes
//! from the guest). Fit M and τ to a trace by least squares, then predict
//! pre-copy iteration by iteration: T0 = memory/bandwidth,
//! D_k = D(T_{k−1}), T_k = D_k·(bytes per page)/bandwidth.
//!
//! Three refinements make it predict tsubame's migrations on this host:
//! t is the guest's own work time ([`GuestClock`]: an
//! iteration of T wall seconds gives the guest Δw with Δw/(1−β) +
//! fault·D(Δw) = T, since dirty logging's faults slow it); a page written
//! before its turn in the iteration goes out with that write (the sender
//! clears dirty bits just before reading), so of the pages being sent only
//! those written after their turn count; and with 2 MiB-backed memory the
//! first iteration re-sends every page of each piece written after its
//! turn.

use serde::Serialize;

use crate::format::Trace;
use crate::simulate::{GuestClock, Method, SimOptions, GUEST_SPEED_WANDER, RECORD_HEADER};
use tsubame_codec::PAGE_SIZE;

/// The fitted model.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DirtyModel {
    /// Pages the workload rewrites.
    pub m: f64,
    /// Half-life in seconds: after τ, half of M is dirty.
    pub tau: f64,
    /// Coefficient of determination of the fit.
    pub r_squared: f64,
    /// Root-mean-square error of the fit, in pages.
    pub rmse: f64,
}

impl DirtyModel {
    /// Distinct pages dirtied in `t` seconds, the guest getting 1 − β of its CPU.
    pub fn dirty(&self, t: f64, beta: f64) -> f64 {
        self.m - self.m * 0.5f64.powf(t * (1.0 - beta) / self.tau)
    }
}

/// Measured D(t): for each window length (seconds of guest work, see
/// [`GuestClock`]), the mean count of distinct pages dirtied in windows of
/// that length across the trace.
pub fn measure_dirty_curve(trace: &Trace) -> Vec<(f64, f64)> {
    let clock = GuestClock::of(trace);
    let span = clock.span;
    let pages = trace.setup.pages() as usize;
    let mut seen = vec![0u64; pages.div_ceil(64)];
    let mut curve = Vec::new();
    // The first interval holds what the guest dirtied while the tracer
    // read all memory: not a window of the workload's steady state.
    let first_work = clock.work.first().copied().unwrap_or(0.0);
    let mut window = (span / trace.intervals.len().max(1) as f64).max(1e-4) * 2.0;
    while window <= (span - first_work) / 2.0 {
        let starts: Vec<f64> = {
            let n = 20usize;
            (0..n).map(|i| first_work + (span - first_work - window) * i as f64 / n as f64).collect()
        };
        let mut total = 0.0;
        for &start in &starts {
            seen.iter_mut().for_each(|w| *w = 0);
            let mut count = 0u64;
            for (interval, &at) in trace.intervals.iter().zip(&clock.work) {
                if at <= start || at > start + window {
                    continue;
                }
                for c in &interval.changes {
                    let (w, b) = ((c.page / 64) as usize, 1u64 << (c.page % 64));
                    if seen[w] & b == 0 {
                        seen[w] |= b;
                        count += 1;
                    }
                }
            }
            total += count as f64;
        }
        curve.push((window, total / starts.len() as f64));
        window *= 1.5;
    }
    curve
}

/// Least-squares fit of M and τ: for a given τ the best M is linear
/// (M = Σ D·f / Σ f², f = 1 − 2^(−t/τ)); τ is searched on a log grid and
/// refined by golden section.
pub fn fit(curve: &[(f64, f64)]) -> Option<DirtyModel> {
    if curve.len() < 3 {
        return None;
    }
    let sse_for = |tau: f64| -> (f64, f64) {
        let f = |t: f64| 1.0 - 0.5f64.powf(t / tau);
        let num: f64 = curve.iter().map(|&(t, d)| d * f(t)).sum();
        let den: f64 = curve.iter().map(|&(t, _)| f(t) * f(t)).sum();
        let m = if den > 0.0 { num / den } else { 0.0 };
        let sse = curve.iter().map(|&(t, d)| (d - m * f(t)).powi(2)).sum();
        (sse, m)
    };
    let mut best = (f64::INFINITY, 1.0);
    let mut tau = 1e-3;
    while tau < 1e4 {
        let (sse, _) = sse_for(tau);
        if sse < best.0 {
            best = (sse, tau);
        }
        tau *= 1.05;
    }
    let (mut lo, mut hi) = (best.1 / 1.05, best.1 * 1.05);
    for _ in 0..60 {
        let a = lo + (hi - lo) * 0.382;
        let b = lo + (hi - lo) * 0.618;
        if sse_for(a).0 < sse_for(b).0 {
            hi = b;
        } else {
            lo = a;
        }
    }
    let tau = (lo + hi) / 2.0;
    let (sse, m) = sse_for(tau);
    let mean = curve.iter().map(|&(_, d)| d).sum::<f64>() / curve.len() as f64;
    let sst: f64 = curve.iter().map(|&(_, d)| (d - mean).powi(2)).sum();
    Some(DirtyModel {
        m,
        tau,
        r_squared: if sst > 0.0 { 1.0 - sse / sst } else { 1.0 },
        rmse: (sse / curve.len() as f64).sqrt(),
    })
}

/// Mean bytes to send one dirty page by `method`, from the trace.
pub fn bytes_per_dirty_page(trace: &Trace, method: Method) -> f64 {
    let g = trace.setup.granularity;
    let per_page = 4096 / g;
    let (mut sum, mut n) = (0.0, 0u64);
    for c in trace.intervals.iter().flat_map(|i| &i.changes) {
        let full = PAGE_SIZE as f64 + RECORD_HEADER;
        sum += match method {
            _ if c.zero => RECORD_HEADER,
            Method::Page => full,
            Method::PageXbzrle => (RECORD_HEADER + c.xbzrle_bytes as f64).min(full),
            Method::Subpage if c.mask.count_ones() == per_page => full,
            Method::Subpage => RECORD_HEADER + 8.0 + (c.mask.count_ones() * g) as f64,
        };
        n += 1;
    }
    if n == 0 {
        PAGE_SIZE as f64 + RECORD_HEADER
    } else {
        sum / n as f64
    }
}

/// A predicted migration.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    /// The method.
    pub method: Method,
    /// Bandwidth in bytes per second.
    pub bandwidth: f64,
    /// Iterations including stop-and-copy.
    pub iterations: u32,
    /// Seconds.
    pub total_time_s: f64,
    /// Seconds.
    pub downtime_s: f64,
    /// Converged within the limits.
    pub converged: bool,
    /// Pages dirty after iteration 0 (what iteration 1 sends).
    pub iteration1_dirty_pages: f64,
    /// Whether it still converges with the guest `GUEST_SPEED_WANDER`
    /// faster (see `simulate::Spread`). A method that converges only at
    /// the traced speed is on the edge.
    pub converged_if_faster: bool,
}

/// Nonzero pages in the 2 MiB pieces the trace writes to: what the first
/// iteration re-sends when memory is mapped in 2 MiB pieces.
fn pages_in_written_pieces(trace: &Trace) -> (f64, f64) {
    let pieces = trace.setup.pages().div_ceil(512) as usize;
    let mut written = vec![false; pieces];
    for c in trace.intervals.iter().skip(1).flat_map(|i| &i.changes) {
        written[(c.page / 512) as usize] = true;
    }
    let pages: u64 =
        (0..trace.setup.pages()).filter(|&p| written[(p / 512) as usize] && trace.is_nonzero(p)).count() as u64;
    (pages as f64, written.iter().filter(|&&w| w).count() as f64)
}

/// Guest work in an iteration of `wall` seconds: Δw/speed + fault·D(Δw) = wall.
fn work_in(model: &DirtyModel, clock: &GuestClock, wall: f64, speed: f64) -> f64 {
    let (mut lo, mut hi) = (0.0, wall * speed);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if mid / speed + clock.fault_s * model.dirty(mid, 0.0) > wall {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    lo
}

/// Pages dirty after an iteration that sent `sending` of the M hot pages
/// (spread evenly over it) while the guest did `work`: a page being sent
/// counts only if written after its turn, any other if written at all.
fn dirty_after(model: &DirtyModel, sending: f64, work: f64) -> f64 {
    let a = std::f64::consts::LN_2 * work / model.tau;
    let written = 1.0 - (-a).exp();
    let after_turn = if a > 1e-9 { 1.0 - written / a } else { 0.0 };
    let sending = sending.min(model.m);
    sending * after_turn + (model.m - sending) * written
}

/// Predicts a pre-copy migration from the model, with tsubame's stop rules.
/// The guest's speed is `options.guest_speed` (1 − β); the prediction also
/// says whether it would converge with the guest `GUEST_SPEED_WANDER`
/// faster.
pub fn predict(trace: &Trace, model: &DirtyModel, method: Method, options: &SimOptions) -> Prediction {
    let mut prediction = predict_at(trace, model, method, options);
    let faster = options.guest_speed_times(1.0 + GUEST_SPEED_WANDER);
    prediction.converged_if_faster = predict_at(trace, model, method, &faster).converged;
    prediction
}

fn predict_at(trace: &Trace, model: &DirtyModel, method: Method, options: &SimOptions) -> Prediction {
    let pages = trace.setup.pages() as f64;
    let nonzero = trace.nonzero_pages() as f64;
    let clock = GuestClock::of(trace);
    let speed = options.guest_speed.max(1e-6);
    let per_page = bytes_per_dirty_page(trace, method);
    let huge = options.huge_pages.unwrap_or(trace.setup.huge_pages);
    let first_bytes = nonzero * (PAGE_SIZE as f64 + RECORD_HEADER) + (pages - nonzero) * RECORD_HEADER;
    let mut duration = first_bytes / options.bandwidth;
    let mut total = duration;
    let mut sent = first_bytes;
    let mut iterations = 1;
    let work = work_in(model, &clock, duration, speed);
    let mut dirty = dirty_after(model, model.m, work);
    let mut bytes = dirty * per_page;
    if huge && method != Method::Subpage {
        // Every piece the workload writes is written after its turn; its
        // unchanged pages cost a whole page (page), or a header (XBZRLE).
        let (piece_pages, pieces) = pages_in_written_pieces(trace);
        let per_piece = model.m / pieces.max(1.0);
        let b = std::f64::consts::LN_2 * work / model.tau * per_piece;
        let after_turn = if b > 1e-9 { 1.0 - (1.0 - (-b).exp()) / b } else { 0.0 };
        let extra = (piece_pages * after_turn - dirty).max(0.0);
        let unchanged = if method == Method::Page { PAGE_SIZE as f64 + RECORD_HEADER } else { RECORD_HEADER };
        dirty += extra;
        bytes += extra * unchanged;
    }
    let first_dirty = dirty;
    loop {
        duration = bytes / options.bandwidth;
        let converged = duration <= options.downtime_limit;
        if converged || iterations >= options.max_iterations || sent > 3.0 * trace.setup.memory_bytes as f64 {
            return Prediction {
                method,
                bandwidth: options.bandwidth,
                iterations: iterations + 1,
                total_time_s: total + duration,
                downtime_s: duration,
                converged,
                iteration1_dirty_pages: first_dirty,
                converged_if_faster: converged,
            };
        }
        total += duration;
        sent += bytes;
        iterations += 1;
        let work = work_in(model, &clock, duration, speed);
        dirty = dirty_after(model, dirty, work);
        bytes = dirty * per_page;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_known_model() {
        let truth = DirtyModel { m: 1e5, tau: 1.32, r_squared: 1.0, rmse: 0.0 };
        let curve: Vec<(f64, f64)> = (1..40).map(|i| (i as f64 * 0.2, truth.dirty(i as f64 * 0.2, 0.0))).collect();
        let fitted = fit(&curve).unwrap();
        assert!((fitted.m - 1e5).abs() < 1.0, "{fitted:?}");
        assert!((fitted.tau - 1.32).abs() < 1e-3, "{fitted:?}");
        assert!(fitted.r_squared > 0.999);
        assert!(fit(&curve[..2]).is_none());
    }

    #[test]
    fn beta_slows_dirtying() {
        let m = DirtyModel { m: 100.0, tau: 1.0, r_squared: 1.0, rmse: 0.0 };
        assert!((m.dirty(1.0, 0.0) - 50.0).abs() < 1e-9);
        assert!((m.dirty(2.0, 0.5) - 50.0).abs() < 1e-9);
    }
}

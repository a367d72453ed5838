//! The SPP paper's pseudo-migration (§5.1): replay a trace against a link
//! of given bandwidth. Iteration 0 sends all memory; each next iteration
//! sends what the trace says was dirtied while the previous one was on the
//! wire; stop when the rest fits the downtime limit, or give up after the
//! iteration limit. Bytes follow tsubame's stream format (a 13-byte record
//! header per page), so results compare with real migrations.

use serde::Serialize;

use crate::auto_converge::AutoConverge;
use crate::format::Trace;
use crate::replay::{run_guest, Dirty, ReplayState};
use tsubame_codec::PAGE_SIZE;

pub use crate::clock::{ClockBasis, GuestClock};

/// Bytes of a page record's header in tsubame's stream.
pub const RECORD_HEADER: f64 = 13.0;

/// How dirty pages are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Whole pages (zero pages as empty records).
    Page,
    /// Whole pages, or their XBZRLE delta when it is smaller (cache
    /// assumed large enough to hold every page sent before).
    PageXbzrle,
    /// Only the changed sub-pages at the trace's granularity.
    Subpage,
}

impl Method {
    /// All methods, in the order printed.
    pub const ALL: [Method; 3] = [Method::Page, Method::PageXbzrle, Method::Subpage];

    /// The name users type.
    pub fn name(self) -> &'static str {
        match self {
            Method::Page => "page",
            Method::PageXbzrle => "page+xbzrle",
            Method::Subpage => "subpage",
        }
    }
}

impl std::str::FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> Result<Method, String> {
        Method::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown method '{s}' (page, page+xbzrle, subpage, all)"))
    }
}

/// The link and the stop rules.
#[derive(Debug, Clone, Copy)]
pub struct SimOptions {
    /// Link bandwidth in bytes per second.
    pub bandwidth: f64,
    /// Stop iterating when the rest takes at most this long (seconds).
    pub downtime_limit: f64,
    /// Give up (stop-and-copy anyway) after this many iterations.
    pub max_iterations: u32,
    /// How fast the guest runs during migration relative to while it was
    /// traced (1 − β in the RDMA paper's model): the trace is replayed
    /// this many trace-seconds per second of migration.
    pub guest_speed: f64,
    /// Whether KVM maps the migrating VM's memory in 2 MiB pieces (`None`:
    /// as the trace says). The first write after the sender write-protects
    /// such a piece dirties all 512 of its pages (measured under PVM: a
    /// 1 GiB `kv` re-sent 95 % of its working set in iteration 1 with huge
    /// pages, against the 27 % its writes alone explain).
    pub huge_pages: Option<bool>,
    /// Throttle the guest as `migrate --auto-converge` does (the same
    /// policy, `crate::auto_converge`): a throttle p leaves the guest
    /// 1 − p of its speed.
    pub auto_converge: bool,
}

impl SimOptions {
    /// The same, with the guest `factor` times as fast.
    pub fn guest_speed_times(&self, factor: f64) -> SimOptions {
        SimOptions { guest_speed: self.guest_speed * factor, ..*self }
    }
}

/// One simulated iteration.
#[derive(Debug, Clone, Serialize)]
pub struct SimIteration {
    /// 0-based; the last is the stop-and-copy.
    pub index: u32,
    /// Pages sent.
    pub pages: u64,
    /// Bytes sent.
    pub bytes: f64,
    /// Seconds on the wire.
    pub duration_s: f64,
    /// The guest's modelled speed while it was on the wire, as a fraction
    /// of its undisturbed speed (0 for the stop-and-copy: paused).
    pub guest_speed: f64,
    /// Share of the time auto-converge made the guest sleep.
    pub throttle: f64,
}

/// A simulated migration.
#[derive(Debug, Clone, Serialize)]
pub struct SimResult {
    /// The method.
    pub method: Method,
    /// Per iteration, stop-and-copy last.
    pub iterations: Vec<SimIteration>,
    /// Start to the end of stop-and-copy.
    pub total_time_s: f64,
    /// The stop-and-copy's time on the wire.
    pub downtime_s: f64,
    /// Stopped because the rest fitted the downtime limit.
    pub converged: bool,
    /// converged or max-iterations.
    pub stop_reason: String,
    /// All bytes sent.
    pub bytes_total: f64,
    /// The same replay with the guest a little slower and faster, when
    /// asked for (`simulate_with_spread`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spread: Option<Spread>,
}

/// How much a guest's speed wanders from second to second and run to run
/// on one host (measured with kv: ±10 %): simulate's default spread and
/// plan's margin.
pub const GUEST_SPEED_WANDER: f64 = 0.1;

/// How a replay's outcome moves when the guest runs `1 ± by` times as
/// fast. The guest's speed wanders ±10 % from second to second and run to
/// run on one host, and near the convergence edge a few percent of speed
/// decide between converging and not, or move the iteration count by
/// several: there a single count promises more than anyone can know, and
/// saying so is the honest answer to "will it migrate, and how?". (The
/// range is not a bound: a real migration varies beyond ±10 % of guest
/// speed too.)
#[derive(Debug, Clone, Serialize)]
pub struct Spread {
    /// The relative change of guest speed tried (0.1: ±10 %).
    pub by: f64,
    /// Fewest and most iterations (stop-and-copy included).
    pub iterations: (usize, usize),
    /// Shortest and longest total time, seconds.
    pub total_time_s: (f64, f64),
    /// Fewest and most bytes.
    pub bytes_total: (f64, f64),
    /// Whether the replay with the faster guest converged.
    pub converged_if_faster: bool,
    /// Whether the replay with the slower guest converged.
    pub converged_if_slower: bool,
}

impl Spread {
    /// Whether the verdict or the iteration count hang on the guest's
    /// speed: it converges one way and not the other, or the iteration
    /// count moves by more than 2.
    pub fn on_edge(&self) -> bool {
        self.converged_if_faster != self.converged_if_slower || self.iterations.1 - self.iterations.0 > 2
    }
}

/// `simulate`, plus the replays with the guest `1 ± by` times as fast.
pub fn simulate_with_spread(trace: &Trace, method: Method, options: &SimOptions, by: f64) -> SimResult {
    simulate_with_spread_reporting(trace, method, options, by, &mut || {})
}

/// Replays `simulate_with_spread` runs for a spread of `by`.
pub fn replays_with_spread(by: f64) -> u64 {
    if by > 0.0 {
        3
    } else {
        1
    }
}

/// `simulate_with_spread`, calling `replayed` after each replay (for a
/// progress bar: [`replays_with_spread`] of them).
pub fn simulate_with_spread_reporting(
    trace: &Trace,
    method: Method,
    options: &SimOptions,
    by: f64,
    replayed: &mut dyn FnMut(),
) -> SimResult {
    let mut at = |factor: f64| {
        let result = simulate(trace, method, &options.guest_speed_times(factor));
        replayed();
        result
    };
    let mut result = at(1.0);
    if by <= 0.0 {
        return result;
    }
    let (slower, faster) = (at(1.0 - by), at(1.0 + by));
    let all = [&result, &slower, &faster];
    let range = |f: &dyn Fn(&SimResult) -> f64| {
        all.iter().map(|r| f(r)).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)))
    };
    let iterations = range(&|r| r.iterations.len() as f64);
    result.spread = Some(Spread {
        by,
        iterations: (iterations.0 as usize, iterations.1 as usize),
        total_time_s: range(&|r| r.total_time_s),
        bytes_total: range(&|r| r.bytes_total),
        converged_if_faster: faster.converged,
        converged_if_slower: slower.converged,
    });
    result
}

/// Bytes to send a dirty page by `method`.
fn cost(method: Method, d: &Dirty, granularity: u32) -> f64 {
    let full = PAGE_SIZE as f64 + RECORD_HEADER;
    let per_page = 4096 / granularity;
    match method {
        Method::Page if d.zero => RECORD_HEADER,
        Method::Page => full,
        Method::PageXbzrle if d.zero => RECORD_HEADER,
        Method::PageXbzrle => (RECORD_HEADER + d.xbzrle as f64).min(full),
        Method::Subpage if d.mask == 0 => 0.0,
        Method::Subpage if d.zero => RECORD_HEADER,
        Method::Subpage if d.mask.count_ones() == per_page => full,
        Method::Subpage => RECORD_HEADER + 8.0 + (d.mask.count_ones() * granularity) as f64,
    }
}

/// Replays `trace` under `method` and `options`, with tsubame's stop
/// rules: converged when the rest fits the downtime limit, else give up
/// after `max_iterations` or once three times the memory was sent.
pub fn simulate(trace: &Trace, method: Method, options: &SimOptions) -> SimResult {
    let pages = trace.setup.pages();
    let granularity = trace.setup.granularity;
    let clock = GuestClock::of(trace);
    let full = PAGE_SIZE as f64 + RECORD_HEADER;
    let mut state = ReplayState::new(trace, options.huge_pages.unwrap_or(trace.setup.huge_pages));
    let mut iterations: Vec<SimIteration> = Vec::new();
    let mut now = 0.0;
    // Iteration 0: every page in order, the non-zero ones whole.
    let mut send_at = vec![f64::NAN; pages as usize];
    let mut bytes = 0.0;
    for p in 0..pages {
        send_at[p as usize] = bytes / options.bandwidth;
        bytes += if trace.is_nonzero(p) { full } else { RECORD_HEADER };
    }
    let mut count = pages;
    let mut auto_converge = AutoConverge::default();
    let (converged, reason, last) = loop {
        let duration = bytes / options.bandwidth;
        let throttle = auto_converge.fraction;
        let speed = options.guest_speed * (1.0 - throttle);
        let work = run_guest(trace, &clock, speed, &mut state, duration, &send_at);
        let guest_speed = if duration > 0.0 { work / duration } else { 0.0 };
        iterations.push(SimIteration {
            index: iterations.len() as u32,
            pages: count,
            bytes,
            duration_s: duration,
            guest_speed,
            throttle,
        });
        now += duration;
        send_at.iter_mut().for_each(|t| *t = f64::NAN);
        bytes = 0.0;
        count = 0;
        for (p, d) in state.dirty.iter() {
            let c = cost(method, d, granularity);
            if c > 0.0 {
                send_at[p as usize] = bytes / options.bandwidth;
                bytes += c;
                count += 1;
            }
        }
        let sent: f64 = iterations.iter().map(|i| i.bytes).sum();
        if bytes / options.bandwidth <= options.downtime_limit {
            break (true, "converged", bytes);
        }
        if iterations.len() as u32 >= options.max_iterations {
            break (false, "max-iterations", bytes);
        }
        if sent > 3.0 * trace.setup.memory_bytes as f64 {
            break (false, "sent-3x-memory", bytes);
        }
        if options.auto_converge && iterations.len() > 1 {
            let just_sent = iterations.last().map_or(0.0, |i| i.bytes);
            auto_converge.after_iteration(bytes, just_sent);
        }
    };
    let downtime = last / options.bandwidth;
    iterations.push(SimIteration {
        index: iterations.len() as u32,
        pages: count,
        bytes: last,
        duration_s: downtime,
        guest_speed: 0.0,
        throttle: auto_converge.fraction,
    });
    SimResult {
        method,
        bytes_total: iterations.iter().map(|i| i.bytes).sum(),
        total_time_s: now + downtime,
        downtime_s: downtime,
        converged,
        stop_reason: reason.into(),
        iterations,
        spread: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Interval, PageChange, Setup};

    /// A link and stop rules; the guest at its traced speed, no throttle.
    fn link(bandwidth: f64, downtime_limit: f64, max_iterations: u32) -> SimOptions {
        SimOptions {
            bandwidth,
            downtime_limit,
            max_iterations,
            guest_speed: 1.0,
            huge_pages: None,
            auto_converge: false,
        }
    }

    /// A trace where 1000 pages get one 8-byte write every 10 ms.
    fn sparse_trace() -> Trace {
        let setup = Setup {
            memory_bytes: 64 << 20,
            granularity: 128,
            interval_us: 10_000,
            workload: "t".into(),
            native_ops_per_sec: 0,
            huge_pages: false,
        };
        let pages = setup.pages();
        let intervals = (1..=200u64)
            .map(|i| Interval {
                at_us: i * 10_000,
                ops: 0,
                changes: (0..1000u64)
                    .map(|p| {
                        let page = (p * 7 + i) % pages;
                        (page, PageChange { page, mask: 1, xbzrle_bytes: 10, zero: false })
                    })
                    .collect::<std::collections::BTreeMap<_, _>>()
                    .into_values()
                    .collect(),
            })
            .collect::<Vec<_>>();
        Trace { setup, nonzero: vec![u64::MAX; (pages / 64) as usize], intervals }
    }

    #[test]
    fn a_spread_is_the_replays_with_the_guest_slower_and_faster() {
        let trace = sparse_trace();
        let options = link(10e6, 0.3, 20);
        for method in Method::ALL {
            let result = simulate_with_spread(&trace, method, &options, 0.2);
            let spread = result.spread.as_ref().unwrap();
            let slower = simulate(&trace, method, &SimOptions { guest_speed: 0.8, ..options });
            let faster = simulate(&trace, method, &SimOptions { guest_speed: 1.2, ..options });
            assert_eq!((spread.converged_if_slower, spread.converged_if_faster), (slower.converged, faster.converged));
            for r in [&result, &slower, &faster] {
                assert!((spread.iterations.0..=spread.iterations.1).contains(&r.iterations.len()), "{method:?}");
                assert!(spread.total_time_s.0 <= r.total_time_s && r.total_time_s <= spread.total_time_s.1);
            }
        }
        // Sub-pages converge here whatever the guest's speed: not on the edge.
        let sub = simulate_with_spread(&trace, Method::Subpage, &options, 0.2);
        assert!(!sub.spread.unwrap().on_edge());
        assert!(simulate_with_spread(&trace, Method::Page, &options, 0.0).spread.is_none());
    }

    #[test]
    fn auto_converge_slows_the_replayed_guest() {
        let trace = sparse_trace();
        let options = link(10e6, 0.3, 100);
        let free = simulate(&trace, Method::Page, &options);
        assert!(free.iterations.iter().all(|i| i.throttle == 0.0));
        let throttled = simulate(&trace, Method::Page, &SimOptions { auto_converge: true, ..options });
        let throttles: Vec<f64> = throttled.iterations.iter().map(|i| i.throttle).collect();
        // Iterations 1 and 2 dirty more than half of what they send: the
        // throttle starts in iteration 3, as the engine's would.
        assert_eq!(throttles[..4], [0.0, 0.0, 0.0, 0.2], "{throttles:?}");
        assert!(throttles.windows(2).all(|w| w[0] <= w[1]), "{throttles:?}");
        let (n, last) = (throttled.iterations.len() - 2, &throttled.iterations[throttled.iterations.len() - 2]);
        assert!(last.guest_speed < free.iterations[n].guest_speed * 0.9, "{last:?}");
        assert!(last.pages < free.iterations[n].pages, "a slower guest dirties fewer pages");
    }

    #[test]
    fn subpage_converges_where_pages_do_not() {
        let trace = sparse_trace();
        // 10 MB/s: a 4 KiB page per write cannot keep up; 150 B can.
        let options = link(10e6, 0.3, 20);
        let page = simulate(&trace, Method::Page, &options);
        let sub = simulate(&trace, Method::Subpage, &options);
        let xbz = simulate(&trace, Method::PageXbzrle, &options);
        assert!(!page.converged, "{page:?}");
        assert_eq!(page.stop_reason, "sent-3x-memory");
        assert!(sub.converged && xbz.converged);
        assert!(sub.bytes_total < page.bytes_total / 2.0);
        assert!((sub.total_time_s - sub.iterations.iter().map(|i| i.duration_s).sum::<f64>()).abs() < 1e-9);
        // A guest nearly stopped during migration dirties nothing in the
        // 6.7 s of iteration 0 (under one 10 ms trace interval): converged.
        let slow = simulate(&trace, Method::Page, &SimOptions { guest_speed: 0.001, ..options });
        assert!(slow.converged && slow.iterations.len() == 2, "{slow:?}");
    }

    /// 8 MiB, all non-zero; the guest rewrites page 0 and page 1000 (of
    /// 2048) every 10 ms.
    fn two_page_trace(huge_pages: bool) -> Trace {
        let setup = Setup {
            memory_bytes: 8 << 20,
            granularity: 128,
            interval_us: 10_000,
            workload: "t".into(),
            native_ops_per_sec: 0,
            huge_pages,
        };
        let change = |page| PageChange { page, mask: 1, xbzrle_bytes: 10, zero: false };
        let intervals = (1..=100u64)
            .map(|i| Interval { at_us: i * 10_000, ops: 0, changes: vec![change(0), change(1000)] })
            .collect();
        Trace { setup, nonzero: vec![u64::MAX; 32], intervals }
    }

    #[test]
    fn writes_before_a_pages_turn_go_out_with_it() {
        // 8 MiB at 8 MB/s: iteration 0 takes ~1 s and reaches page 1000
        // about halfway, page 0 at once. Both are written all along, so
        // both are dirty again; nothing else is.
        let options = link(8e6, 0.01, 3);
        let r = simulate(&two_page_trace(false), Method::Page, &options);
        assert_eq!(r.iterations[1].pages, 2, "{r:?}");
        // With 2 MiB pieces, the first write after each page's turn
        // dirties its whole piece (pages 0..512 and 512..1024) once.
        let r = simulate(&two_page_trace(true), Method::Page, &options);
        assert_eq!(r.iterations[1].pages, 1024, "{r:?}");
        assert_eq!(r.iterations[2].pages, 2, "{r:?}");
        // Sub-pages send nothing for the unchanged pages of a piece.
        let r = simulate(&two_page_trace(true), Method::Subpage, &options);
        assert_eq!(r.iterations[1].pages, 2, "{r:?}");
    }

    #[test]
    fn a_replay_past_the_end_skips_the_tracers_warm_up() {
        // 1 s of trace: the first 100 ms write 500 other pages (the
        // tracer's warm-up), then only pages 0 and 1 are written.
        let mut trace = two_page_trace(false);
        let change = |page| PageChange { page, mask: 1, xbzrle_bytes: 10, zero: false };
        for (i, interval) in trace.intervals.iter_mut().take(10).enumerate() {
            interval.changes = std::iter::once(0).chain(100 + 50 * i as u64..150 + 50 * i as u64).map(change).collect();
        }
        assert!((49..=51).contains(&GuestClock::of(&trace).loop_from));
        // 1 MB/s: iteration 0 takes ~8 s, eight passes over the trace; the
        // 500 pages are written long before their turn (0.4-2.4 s) and,
        // the warm-up not coming back, never after it.
        let options = link(1e6, 0.001, 2);
        let r = simulate(&trace, Method::Page, &options);
        assert_eq!(r.iterations[1].pages, 2, "{r:?}");
    }

    #[test]
    fn methods_parse() {
        assert_eq!("page+xbzrle".parse::<Method>().unwrap(), Method::PageXbzrle);
        assert!("pages".parse::<Method>().is_err());
    }
}

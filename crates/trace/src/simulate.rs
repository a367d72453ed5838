//! The SPP paper's pseudo-migration (§5.1): replay a trace against a link
//! of given bandwidth. Iteration 0 sends all memory; each next iteration
//! sends what the trace says was dirtied while the previous one was on the
//! wire; stop when the rest fits the downtime limit, or give up after the
//! iteration limit. Bytes follow tsubame's stream format (a 13-byte record
//! header per page), so results compare with real migrations.

use serde::Serialize;

use crate::format::{Trace, PAGE};

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
#[derive(Debug, Clone)]
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
}

/// What one page costs to send once it is dirty.
#[derive(Debug, Clone, Copy, Default)]
struct Dirty {
    mask: u64,
    xbzrle: u32,
    zero: bool,
}

/// Pages dirtied in the trace between two times (seconds since start);
/// times past the end wrap around, as if the workload repeated.
fn dirty_between(trace: &Trace, from: f64, to: f64, out: &mut std::collections::BTreeMap<u64, Dirty>) {
    out.clear();
    let span = trace.duration_s();
    if span <= 0.0 || to <= from {
        return;
    }
    let mut lap = (from / span).floor();
    loop {
        let base = lap * span;
        if base >= to {
            break;
        }
        for interval in &trace.intervals {
            let at = base + interval.at_us as f64 / 1e6;
            if at <= from || at > to {
                continue;
            }
            for c in &interval.changes {
                let d = out.entry(c.page).or_default();
                d.mask |= c.mask;
                d.xbzrle = (d.xbzrle + c.xbzrle_bytes).min(PAGE as u32 + 1);
                d.zero = c.zero;
            }
        }
        lap += 1.0;
    }
}

/// Bytes to send a dirty page by `method`.
fn cost(method: Method, d: &Dirty, granularity: u32) -> f64 {
    let full = PAGE as f64 + RECORD_HEADER;
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

/// Replays `trace` under `method` and `options`.
pub fn simulate(trace: &Trace, method: Method, options: &SimOptions) -> SimResult {
    let pages = trace.setup.pages();
    let nonzero = trace.nonzero_pages();
    let first_bytes = nonzero as f64 * (PAGE as f64 + RECORD_HEADER) + (pages - nonzero) as f64 * RECORD_HEADER;
    let mut iterations = Vec::new();
    let mut now = 0.0;
    let mut bytes = first_bytes;
    let mut count = pages;
    let mut dirty = std::collections::BTreeMap::new();
    let (converged, reason) = loop {
        let duration = bytes / options.bandwidth;
        iterations.push(SimIteration { index: iterations.len() as u32, pages: count, bytes, duration_s: duration });
        dirty_between(trace, now * options.guest_speed, (now + duration) * options.guest_speed, &mut dirty);
        now += duration;
        let next: f64 = dirty.values().map(|d| cost(method, d, trace.setup.granularity)).sum();
        count = dirty.values().filter(|d| cost(method, d, trace.setup.granularity) > 0.0).count() as u64;
        bytes = next;
        if next / options.bandwidth <= options.downtime_limit {
            break (true, "converged");
        }
        if iterations.len() as u32 >= options.max_iterations {
            break (false, "max-iterations");
        }
    };
    let downtime = bytes / options.bandwidth;
    iterations.push(SimIteration { index: iterations.len() as u32, pages: count, bytes, duration_s: downtime });
    SimResult {
        method,
        bytes_total: iterations.iter().map(|i| i.bytes).sum(),
        total_time_s: now + downtime,
        downtime_s: downtime,
        converged,
        stop_reason: reason.into(),
        iterations,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Interval, PageChange, Setup};

    /// A trace where 1000 pages get one 8-byte write every 10 ms.
    fn sparse_trace() -> Trace {
        let setup = Setup { memory_bytes: 64 << 20, granularity: 128, interval_us: 10_000, workload: "t".into() };
        let pages = setup.pages();
        let intervals = (1..=200u64)
            .map(|i| Interval {
                at_us: i * 10_000,
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
    fn subpage_converges_where_pages_do_not() {
        let trace = sparse_trace();
        // 10 MB/s: a 4 KiB page per write cannot keep up; 150 B can.
        let options = SimOptions { bandwidth: 10e6, downtime_limit: 0.3, max_iterations: 20, guest_speed: 1.0 };
        let page = simulate(&trace, Method::Page, &options);
        let sub = simulate(&trace, Method::Subpage, &options);
        let xbz = simulate(&trace, Method::PageXbzrle, &options);
        assert!(!page.converged, "{page:?}");
        assert_eq!(page.iterations.len(), 21);
        assert!(sub.converged && xbz.converged);
        assert!(sub.bytes_total < page.bytes_total / 2.0);
        assert!((sub.total_time_s - sub.iterations.iter().map(|i| i.duration_s).sum::<f64>()).abs() < 1e-9);
        // A guest nearly stopped during migration dirties nothing in the
        // 6.7 s of iteration 0 (under one 10 ms trace interval): converged.
        let slow = simulate(&trace, Method::Page, &SimOptions { guest_speed: 0.001, ..options });
        assert!(slow.converged && slow.iterations.len() == 2, "{slow:?}");
    }

    #[test]
    fn methods_parse() {
        assert_eq!("page+xbzrle".parse::<Method>().unwrap(), Method::PageXbzrle);
        assert!("pages".parse::<Method>().is_err());
    }
}

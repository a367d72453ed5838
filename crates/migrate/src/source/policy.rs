//! When pre-copy stops iterating (Clark et al.; the limits of Xen and
//! QEMU): once what is left should go out within the downtime limit and
//! stopped shrinking fast, or after the iteration limit, or once three
//! times memory went out. Also when auto-converge slows the guest, and
//! when pre-copy hands over to post-copy (`--postcopy`): after N
//! iterations, or (auto) once the guest dirties memory about as fast as
//! the link carries it (within the first iteration: [`super::handover`]).

use std::time::Duration;

use tsubame_trace::auto_converge::AutoConverge;
use tsubame_vmm::PAGE_SIZE;

use super::link::LinkRate;
use crate::options::{MigrateOptions, PostcopyMode};
use crate::protocol::pages::RECORD_HEADER;
use crate::stats::{IterationStats, StopReason};

/// What the policy learned from the iterations so far.
pub struct PrecopyPolicy {
    /// Measured throughput, bytes per second (capped by the option): what
    /// the link carried while the guest ran, page work included.
    bandwidth: f64,
    /// The link's capacity, bytes per second: an iteration's bytes over
    /// its senders' busy time. What the stop's pages take to send, on top
    /// of nothing: their work is counted apart. (Measured as throughput, a
    /// kv guest's link was 45-67 MB/s at 10 Gbit/s, bound by its
    /// iterations' page work, which the estimate then counted twice; a 4
    /// GiB guest's 3 MB/s at 1 Gbit/s, from the first iteration's scan of
    /// zero pages.)
    capacity: f64,
    /// Bytes on the wire per page sent, from the iterations after the
    /// first: what each page the guest dirties costs the link.
    bytes_per_page: f64,
    /// Bytes on the wire per dirty page, from the same iterations: what a
    /// stop sends (with sub-pages a dirty page whose pieces did not change
    /// sends nothing: a kv guest's sent a third of its dirty pages).
    bytes_per_dirty_page: f64,
    /// The guest's throttle, when `auto_converge` is on.
    pub auto_converge: AutoConverge,
    /// The link's round trip (channel 0's lowest), when known.
    pub round_trip: Duration,
    /// The page stages' CPU time per dirty page (fetching, comparing,
    /// encoding; [`IterationStats::work_cpu_ms`]): the median of the last
    /// three iterations with enough pages to tell. CPU time, not wall:
    /// beside the guest the stages wait for a CPU, the more so in some
    /// half hours than others (a kv guest's whole pages took 3.4 µs a page
    /// of wall time and 1.2 of CPU time; its stop, with the guest paused,
    /// 1.2 of CPU time), and one sample in three may be such.
    work_per_page: Duration,
    /// The last such iterations' time per dirty page, oldest first.
    work_samples: Vec<Duration>,
    /// Hashing a page in cache, as the stop's fetch does with each page
    /// it reads ([`crate::digest::page_hash_cost`]; the destination's
    /// decoders hash as they write, nothing is left at STATE). The digest
    /// thread's cost per page, counted before, includes reading scattered
    /// pages: 3-4 µs a page for a kv guest.
    pub hash_per_page: Duration,
}

/// Pages an iteration must have for its work per page to count: fewer
/// measure the work per batch (484 pages scattered over 4 GiB took 34 µs
/// each, a few thousand close together 0.6 µs, when a clear of the dirty
/// log per batch still counted).
const WORK_SAMPLE: u64 = 1024;
/// The samples of work per page the estimate takes the median of.
const WORK_SAMPLES: usize = 3;
/// The pipeline's latency to the end of an iteration, which the stop's
/// last pages pay however few (0.1-0.35 ms for a handful here, part of
/// it counted in [`STOP_WORK`]); the work on a larger stop's pages hides
/// it. (Measured from short iterations it ran 0.2-5 ms with the guest
/// running beside it, too noisy to go by.)
const LATENCY: Duration = Duration::from_micros(100);
/// The stop's wall time per page against its iterations' CPU time per
/// page (the median, see [`PrecopyPolicy::work_per_page`]), hashing aside:
/// about the fetch's share, as a stop's encoders run beside the fetch on
/// CPUs of their own. Fitted with [`DESTINATION_PER_PAGE`] over 32 kv and
/// bwmem stops at 10 Gbit/s on this 2-core host (25 within 20 %): a stop
/// costs 0.5-1.9 times this from one run to the next.
const STOP_WORK_FACTOR: f64 = 0.65;
/// What the destination spends on each page sent in the stop that the
/// source's work does not hide: it decodes, writes and hashes the page.
const DESTINATION_PER_PAGE: Duration = Duration::from_nanos(2000);

/// The least an iteration must send to measure the link's rate by.
const RATE_SAMPLE: u64 = 4 << 20;
/// The most the link's capacity is taken to exceed an iteration's
/// throughput by, however idle its senders: a sender whose bytes the
/// socket's buffer took at once was idle while the link still carried
/// them.
const MAX_IDLE_LINK: f64 = 10.0;

/// The stop's work besides sending pages and waiting for round trips, on
/// both ends: pausing the vCPU and saving its state, the last look at the
/// dirty log, both digests' last pages, starting the vCPU at the
/// destination (its state loads while the last pages land). Measured on
/// this 2-core host for an idle 4 GiB guest's stops of 1-2 pages: 0.42-0.57
/// ms of VMM downtime, of which 0.1-0.15 ms the pipeline's latency
/// ([`LATENCY`]) and ~0.05 ms two round trips; in timed runs 0.05-0.07 ms
/// pausing, 0.15-0.24 from the digest's last frame to READY, 0.07-0.13 the
/// commit. (0.69-1.01 ms before the stop's digest took lists, not copies
/// of whole-memory bitmaps, and the destination loaded the state before
/// the check; 1.2-1.9 before the commit ran under SCHED_FIFO.) Pausing
/// the vCPU sometimes takes 3-60 ms, which no estimate foresees.
const STOP_WORK: Duration = Duration::from_micros(400);

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
    /// Hand over to post-copy, for this reason.
    Postcopy(Handover),
}

/// Why pre-copy handed over to post-copy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Handover {
    /// `--postcopy after=N`.
    After(u32),
    /// Pre-copy would have stopped unconverged, for this reason.
    WouldStop(StopReason),
    /// During an iteration the guest dirtied this many bytes while the link
    /// carried that many (auto).
    Outruns { dirtied: f64, carried: f64 },
    /// The last looks before a stop kept finding more dirty than the
    /// downtime limit allows: a stop now would be this long.
    OverLimit { expected: Duration, limit: Duration },
}

impl Handover {
    /// One line for the summary and the JSON's `choices`.
    pub fn why(&self) -> String {
        match self {
            Handover::After(n) => format!("asked for: after {n} pre-copy iteration(s)"),
            Handover::WouldStop(reason) => format!("pre-copy would have stopped unconverged ({})", reason.name()),
            Handover::Outruns { dirtied, carried } => format!(
                "the guest dirtied {:.0} MB while the link carried {:.0} MB: pre-copy would not converge",
                dirtied / 1e6,
                carried / 1e6
            ),
            Handover::OverLimit { expected, limit } => format!(
                "the last looks before the stop found a {:.0} ms stop, over the {:.0} ms downtime limit",
                expected.as_secs_f64() * 1e3,
                limit.as_secs_f64() * 1e3
            ),
        }
    }
}

/// Once the rest fits the downtime limit, pre-copy goes on while an
/// iteration leaves at most this share of what it sent dirty: the next
/// one takes about as long as the stop would have, and leaves a stop at
/// most half as long (a guest that dirtied 600 pages of 4 GiB during its
/// first iteration at 1 Gbit/s stopped 25 ms; two short iterations more
/// leave a few pages).
const SHRINKING: f64 = 0.5;
/// A stop this short is left as it is: the fixed costs (pausing, the
/// state, the round trips of the commit) are about as long.
const SHORT_ENOUGH: Duration = Duration::from_millis(1);

/// Whether pre-copy, whose rest now fits the downtime limit, should still
/// iterate because the dirty set is still shrinking fast (the end game);
/// `pages_time`: how long the rest takes to send and hash.
fn ends_sooner_later(
    it: &IterationStats,
    remaining: u64,
    iterations: u32,
    pages_time: Duration,
    options: &MigrateOptions,
) -> bool {
    pages_time > SHORT_ENOUGH
        && iterations < options.max_iterations
        && remaining as f64 <= SHRINKING * it.dirty_pages as f64
}

/// Dirtying at this share of the link's rate or more is not converging:
/// each iteration re-sends about as much as the last.
pub(super) const NOT_CONVERGING: f64 = 0.9;

impl Default for PrecopyPolicy {
    fn default() -> Self {
        PrecopyPolicy {
            bandwidth: 0.0,
            capacity: 0.0,
            bytes_per_page: (PAGE_SIZE + RECORD_HEADER) as f64,
            bytes_per_dirty_page: (PAGE_SIZE + RECORD_HEADER) as f64,
            auto_converge: AutoConverge::default(),
            round_trip: Duration::ZERO,
            work_per_page: Duration::ZERO,
            hash_per_page: Duration::ZERO,
            work_samples: Vec::new(),
        }
    }
}

impl PrecopyPolicy {
    /// The policy before any iteration, with this host's cost of hashing
    /// a page.
    pub fn for_this_host() -> PrecopyPolicy {
        PrecopyPolicy { hash_per_page: crate::digest::page_hash_cost(), ..PrecopyPolicy::default() }
    }

    /// Learns from an iteration just sent; returns the bandwidth to assume
    /// from now on (bytes per second).
    pub fn observe(&mut self, it: &IterationStats, options: &MigrateOptions) -> f64 {
        // Iteration 0 also carries never-touched memory (cheap zero
        // records), which says nothing about what the guest dirties:
        // estimate later rounds from later rounds only.
        if it.index > 0 && it.pages_sent > 0 {
            self.bytes_per_page = it.bytes_on_wire as f64 / it.pages_sent as f64;
            self.bytes_per_dirty_page = it.bytes_on_wire as f64 / it.dirty_pages.max(it.pages_sent) as f64;
        }
        // A short iteration measures its latency, not the link: a few
        // hundred KiB of the end game's went out at a fifth of the rate.
        if it.duration_ms > 1.0 && (it.bytes_on_wire >= RATE_SAMPLE || self.bandwidth == 0.0) {
            self.bandwidth = it.bytes_on_wire as f64 / (it.duration_ms / 1e3);
            self.capacity = capacity(it.bytes_on_wire, it.duration_ms, it.send_ms);
        }
        if it.index > 0 && it.dirty_pages >= WORK_SAMPLE {
            if self.work_samples.len() == WORK_SAMPLES {
                self.work_samples.remove(0);
            }
            self.work_samples.push(Duration::from_secs_f64(it.work_cpu_ms / 1e3 / it.dirty_pages as f64));
            let mut sorted = self.work_samples.clone();
            sorted.sort();
            // Of two, their mean.
            self.work_per_page = (sorted[(sorted.len() - 1) / 2] + sorted[sorted.len() / 2]) / 2;
        }
        self.bandwidth_for(options)
    }

    /// How long a stop with `pages` dirty pages should take: sending
    /// them (bound by the link or by the work on each page), hashing them,
    /// the stop's own work and its two round trips (the digest's check,
    /// the commit).
    pub fn expected(&self, pages: u64, options: &MigrateOptions) -> Duration {
        self.pages_time(pages, options) + STOP_WORK + 2 * self.round_trip
    }

    /// Whether the dirty set grew so much between the look that decided
    /// to stop (`decided` pages) and the last one before the pause (`now`;
    /// the digest went and the link drained meanwhile) that one more
    /// iteration should send it first: past the downtime limit, or its
    /// pages' time more than doubled and over [`SHORT_ENOUGH`] (a bwmem
    /// guest at 10 Gbit/s went from 2485 dirty pages to 7287, and its stop
    /// from 5 ms to 12).
    pub fn grew_too_much(&self, decided: u64, now: u64, options: &MigrateOptions) -> bool {
        self.expected(now, options) > options.downtime_limit
            || self.pages_time(now, options) > (2 * self.pages_time(decided, options)).max(SHORT_ENOUGH)
    }

    /// The part of a stop that grows with its dirty pages: the longer of
    /// sending them and the work on them (the source's on each dirty page,
    /// hashing it, the destination's on each page sent), or for a few the
    /// pipeline's latency. The work goes on while the link carries what it
    /// made: added to the link's time, it put whole-page stops at 10
    /// Gbit/s at 0.66-0.88 of their estimate.
    fn pages_time(&self, pages: u64, options: &MigrateOptions) -> Duration {
        let per_page = |cost: Duration| Duration::from_secs_f64(cost.as_secs_f64() * pages as f64);
        // Pages sent per dirty page (a kv guest's sub-pages sent a third,
        // a bwmem guest's almost none).
        let sent_per_dirty_page = self.bytes_per_dirty_page / self.bytes_per_page;
        let work = per_page(self.work_per_page.mul_f64(STOP_WORK_FACTOR))
            + per_page(self.hash_per_page)
            + per_page(DESTINATION_PER_PAGE.mul_f64(sent_per_dirty_page));
        self.sending(pages, options).max(work).max(LATENCY)
    }

    /// How long sending `pages` dirty pages should take.
    fn sending(&self, pages: u64, options: &MigrateOptions) -> Duration {
        Duration::from_secs_f64(pages as f64 * self.bytes_per_dirty_page / self.capacity_for(options))
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
        let expected = self.expected(remaining, options);
        let stop = if remaining == 0 {
            Some(StopReason::NoDirtyPages)
        } else if expected <= options.downtime_limit {
            if ends_sooner_later(it, remaining, iterations, self.pages_time(remaining, options), options) {
                return Decision::Continue { throttle: None };
            }
            Some(StopReason::Converged)
        } else if iterations >= options.max_iterations {
            Some(StopReason::MaxIterations)
        } else if sent > 3 * memory_bytes {
            Some(StopReason::Sent3xMemory)
        } else {
            None
        };
        match (stop, options.postcopy) {
            (Some(reason), _) if reason.converged() => return Decision::Stop(reason),
            (_, PostcopyMode::After(n)) if iterations >= n => return Decision::Postcopy(Handover::After(n)),
            (Some(reason), PostcopyMode::Auto) => return Decision::Postcopy(Handover::WouldStop(reason)),
            (Some(reason), _) => return Decision::Stop(reason),
            // With auto-converge the throttle gets its chance first: post-copy
            // only where pre-copy would stop unconverged.
            (None, PostcopyMode::Auto) if it.index > 0 && it.duration_ms > 0.0 && !options.auto_converge => {
                // What the guest dirtied during the iteration, against what
                // the link carried in the same time.
                let dirtied = remaining as f64 * self.bytes_per_page;
                let carried = self.bandwidth_for(options) * it.duration_ms / 1e3;
                if dirtied >= NOT_CONVERGING * carried {
                    return Decision::Postcopy(Handover::Outruns { dirtied, carried });
                }
            }
            _ => {}
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
        LinkRate::of(options).at_most_cap(self.bandwidth).max(1.0)
    }

    /// The link's measured capacity, capped by `--max-bandwidth`.
    fn capacity_for(&self, options: &MigrateOptions) -> f64 {
        LinkRate::of(options).at_most_cap(self.capacity).max(1.0)
    }

    /// The rate the codecs' payoff checks weigh their time against: the
    /// link's capacity (capped by `--max-bandwidth`), not the throughput,
    /// which a slow codec lowers itself (zstd kept itself on at 10 Gbit/s
    /// by the 150 MB/s it left the link: 6.8 s where raw pages took 2.4);
    /// 0 while unknown (no judgement).
    pub fn codec_link_rate(&self, options: &MigrateOptions) -> f64 {
        if self.capacity > 0.0 {
            self.capacity_for(options)
        } else {
            0.0
        }
    }

    /// Takes a first look at the link's capacity from the iteration in
    /// progress (`bytes` out in `elapsed_ms`, the senders busy `send_ms`)
    /// while no iteration has measured it: the codecs judge from then on,
    /// not only after the first iteration (a 2 GiB guest's at 10 Gbit/s).
    pub fn first_look(&mut self, bytes: u64, elapsed_ms: f64, send_ms: f64) {
        if self.capacity == 0.0 && Self::enough_for_a_look(bytes) {
            self.capacity = capacity(bytes, elapsed_ms, send_ms);
        }
    }

    /// Whether `bytes` out are enough for [`Self::first_look`] to measure by.
    pub fn enough_for_a_look(bytes: u64) -> bool {
        bytes >= RATE_SAMPLE
    }
}

/// The link's capacity from `bytes` out in `elapsed_ms`, the senders busy
/// `send_ms` of it: senders always busy, the throughput; senders mostly
/// waiting for pages, the link could have carried more.
fn capacity(bytes: u64, elapsed_ms: f64, send_ms: f64) -> f64 {
    let busy = send_ms.clamp(elapsed_ms / MAX_IDLE_LINK, elapsed_ms);
    bytes as f64 / (busy / 1e3)
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
            // The link bounds it: its senders were busy throughout.
            send_ms: ms,
            ..Default::default()
        }
    }

    #[test]
    fn an_iteration_bound_by_its_page_work_measures_the_link_by_its_senders() {
        let options = MigrateOptions { postcopy: PostcopyMode::Off, ..MigrateOptions::default() };
        let mut policy = PrecopyPolicy::default();
        // 8 MB in 160 ms, the senders busy 16 ms of it: the link carries
        // 500 MB/s, although the iteration went out at 50 MB/s. (Too few
        // pages for a work sample.)
        let work_bound = IterationStats { work_cpu_ms: 150.0, send_ms: 16.0, ..iteration(1, 1000, 8_000_000, 160.0) };
        assert_eq!(policy.observe(&work_bound, &options), 5e7);
        let close = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_micros(10);
        // Every dirty page was sent; the destination's work on them (2 ms)
        // goes on while the link carries the rest.
        let fixed = STOP_WORK;
        // 8000 bytes a dirty page: 1000 pages take 16 ms to send, not 160.
        assert!(close(policy.expected(1000, &options), fixed + Duration::from_millis(16)));
        // Senders that were never busy: at most ten times the throughput.
        policy.observe(&IterationStats { send_ms: 0.0, ..work_bound }, &options);
        assert!(close(policy.expected(1000, &options), fixed + Duration::from_millis(16)));
        // The cap bounds it too.
        let capped = MigrateOptions { max_bandwidth: Some(100_000_000), ..options };
        assert!(close(policy.expected(1000, &capped), fixed + Duration::from_millis(80)));
    }

    #[test]
    fn codecs_weigh_their_time_against_the_links_capacity_from_a_first_look_on() {
        let options = MigrateOptions::default();
        let mut policy = PrecopyPolicy::default();
        assert_eq!(policy.codec_link_rate(&options), 0.0, "unknown before any look");
        // A look too small to tell, then 10 MB in 100 ms, the senders busy
        // 10 ms of it (a slow codec starves them): 1 GB/s, not 100 MB/s.
        policy.first_look(RATE_SAMPLE - 1, 100.0, 100.0);
        assert_eq!(policy.codec_link_rate(&options), 0.0);
        policy.first_look(10_000_000, 100.0, 10.0);
        assert_eq!(policy.codec_link_rate(&options), 1e9);
        // Only a first look: the iterations measure it from then on.
        policy.first_look(10_000_000, 100.0, 100.0);
        assert_eq!(policy.codec_link_rate(&options), 1e9);
        let it = IterationStats { send_ms: 40.0, ..iteration(0, 1000, 20_000_000, 200.0) };
        assert_eq!(policy.observe(&it, &options), 1e8, "the throughput, for the progress line");
        assert_eq!(policy.codec_link_rate(&options), 5e8);
        let capped = MigrateOptions { max_bandwidth: Some(125_000_000), ..options };
        assert_eq!(policy.codec_link_rate(&capped), 1.25e8);
    }

    #[test]
    fn expected_downtime_counts_the_work_on_each_page() {
        let options = MigrateOptions { postcopy: PostcopyMode::Off, ..MigrateOptions::default() };
        let mut policy = PrecopyPolicy::default();
        // The destination's work on 2000 dirty pages of which this share
        // was sent, and the stop's work for this many µs a page.
        let landing = |share: f64| DESTINATION_PER_PAGE.mul_f64(2000.0 * share);
        let work = |micros: f64| Duration::from_micros(2000).mul_f64(micros * STOP_WORK_FACTOR);
        // 100 MB/s, 1000 bytes per page: 2000 pages take 20 ms to send, and
        // the destination's work on them (4 ms) goes on meanwhile.
        policy.observe(&iteration(0, 100_000, 409_600_000, 4096.0), &options);
        policy.observe(&iteration(1, 100, 100_000, 5.0), &options);
        let close = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_micros(10);
        assert!(close(policy.expected(2000, &options), STOP_WORK + Duration::from_millis(20)));
        // A handful of pages pays the pipeline's latency.
        assert!(close(policy.expected(2, &options), STOP_WORK + LATENCY));
        // An iteration of 2000 dirty pages of which 100 changed, with 6 ms
        // of work: 2000 pages take 6 ms of work (less in the stop) and the
        // destination's on 100 of them, more than the wire's 1 ms.
        let compared = IterationStats { dirty_pages: 2000, work_cpu_ms: 6.0, ..iteration(2, 100, 100_000, 7.0) };
        policy.observe(&compared, &options);
        assert!(close(policy.expected(2000, &options), STOP_WORK + work(3.0) + landing(0.05)));
        // A few scattered pages say nothing about the work per page.
        let scattered =
            IterationStats { dirty_pages: 10, pages_sent: 1, work_cpu_ms: 1.0, ..iteration(3, 10, 1000, 1.5) };
        policy.observe(&scattered, &options);
        assert!(close(policy.expected(2000, &options), STOP_WORK + work(3.0) + landing(0.1)));
        // The median of the last three samples counts, of two their mean:
        // 3 µs a page, then 6 (4.5), then 4 (4), then 1 (of 6, 4, 1: 4).
        let slower = IterationStats { dirty_pages: 2000, work_cpu_ms: 12.0, ..iteration(4, 100, 100_000, 13.0) };
        policy.observe(&slower, &options);
        assert!(close(policy.expected(2000, &options), STOP_WORK + work(4.5) + landing(0.05)));
        policy.observe(&IterationStats { work_cpu_ms: 8.0, ..slower }, &options);
        assert!(close(policy.expected(2000, &options), STOP_WORK + work(4.0) + landing(0.05)));
        policy.observe(&IterationStats { work_cpu_ms: 2.0, ..slower }, &options);
        assert!(close(policy.expected(2000, &options), STOP_WORK + work(4.0) + landing(0.05)));
        // Hashing them comes on top.
        policy.hash_per_page = Duration::from_micros(1);
        assert!(close(
            policy.expected(2000, &options),
            STOP_WORK + work(4.0) + landing(0.05) + Duration::from_millis(2)
        ));
        // The work goes on while a slower link carries the pages: 100 KB
        // at 1 MB/s.
        let slow = MigrateOptions { max_bandwidth: Some(1_000_000), ..options };
        assert!(close(policy.expected(2000, &slow), STOP_WORK + Duration::from_millis(100)));
    }

    #[test]
    fn stops_when_the_rest_fits_the_limit() {
        // 300 ms; pre-copy only (auto hands over instead of the last two).
        let options = MigrateOptions { postcopy: PostcopyMode::Off, ..MigrateOptions::default() };
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

    #[test]
    fn iterates_on_while_the_rest_halves() {
        let options = MigrateOptions { postcopy: PostcopyMode::Off, ..MigrateOptions::default() };
        let mut policy = PrecopyPolicy::default();
        // 100 MB/s: the first iteration sent 10 000 pages and left 600.
        let first = iteration(0, 10_000, 41_090_000, 410.9);
        policy.observe(&first, &options);
        assert_eq!(policy.decide(&first, 600, 1, 0, 1 << 30, &options), Decision::Continue { throttle: None });
        // The next sent those 600 and left 400: not shrinking enough.
        let second = iteration(1, 600, 2_465_400, 24.6);
        assert_eq!(policy.decide(&second, 400, 2, 0, 1 << 30, &options), Decision::Stop(StopReason::Converged));
        // Left 20 (0.8 ms): short enough, whatever comes next.
        assert_eq!(policy.decide(&second, 20, 2, 0, 1 << 30, &options), Decision::Stop(StopReason::Converged));
        // At the iteration limit it stops too.
        assert_eq!(policy.decide(&first, 600, 30, 0, 1 << 30, &options), Decision::Stop(StopReason::Converged));
    }

    #[test]
    fn postcopy_after_n_iterations_or_when_not_converging() {
        let after = MigrateOptions { postcopy: PostcopyMode::After(2), ..MigrateOptions::default() };
        let auto = MigrateOptions { postcopy: PostcopyMode::Auto, ..MigrateOptions::default() };
        let mut policy = PrecopyPolicy::default();
        let it = iteration(1, 10_000, 41_090_000, 410.9); // 100 MB/s
        policy.observe(&it, &after);
        // Converged is converged, whatever the mode.
        assert_eq!(policy.decide(&it, 7000, 2, 0, 1 << 30, &after), Decision::Stop(StopReason::Converged));
        assert_eq!(policy.decide(&it, 8000, 1, 0, 1 << 30, &after), Decision::Continue { throttle: None });
        assert_eq!(policy.decide(&it, 8000, 2, 0, 1 << 30, &after), Decision::Postcopy(Handover::After(2)));
        // Auto: 8000 pages dirtied while 10000 went out is 0.8 of the link;
        // 9500 is not converging; and a limit reached hands over too.
        assert_eq!(policy.decide(&it, 8000, 2, 0, 1 << 30, &auto), Decision::Continue { throttle: None });
        assert!(matches!(policy.decide(&it, 9500, 2, 0, 1 << 30, &auto), Decision::Postcopy(Handover::Outruns { .. })));
        assert_eq!(
            policy.decide(&it, 8000, 30, 0, 1 << 30, &auto),
            Decision::Postcopy(Handover::WouldStop(StopReason::MaxIterations))
        );
        // What the summary says of a guest that outran the link.
        let why = Handover::Outruns { dirtied: 90e6, carried: 60e6 }.why();
        assert!(why.starts_with("the guest dirtied 90 MB while the link carried 60 MB"), "{why}");
    }
}

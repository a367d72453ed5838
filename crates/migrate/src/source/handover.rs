//! Auto post-copy's watch over a first iteration: a guest that dirties
//! memory about as fast as the link carries it (or far faster) is handed
//! over at once, not after an iteration that only sends what it rewrites.

use std::time::Duration;

use tsubame_codec::chooser::UNKNOWN_SAVING;
use tsubame_vmm::{DirtyBitmap, PAGE_SIZE};

use super::policy::NOT_CONVERGING;

/// How long a page must have been out before its re-dirtying counts.
const EXPOSURE: Duration = Duration::from_secs(1);
/// A shorter look, for a guest that dirties memory much faster than the
/// link carries it: such a guest shows it within a quarter second, and
/// every second more of pre-copy only sends pages it rewrites.
const SHORT_EXPOSURE: Duration = Duration::from_millis(250);
/// Dirtying at this share of the link's rate or more, seen over the short
/// look, hands over at once. A guest that rewrites a small hot set looks
/// fast over a short look and slower over a long one (its rewrites of the
/// same pages stop counting), so the short look asks for a wide margin.
const FAR_FROM_CONVERGING: f64 = 2.0;
/// A rate seen over twice the short look that holds at least this share
/// of the short look's is the guest's own, not a small hot set's (whose
/// rate halves as the look doubles): then [`NOT_CONVERGING`] suffices.
const STEADY: f64 = 0.8;
/// How often a long first iteration checks the guest's dirtying, and how
/// often while the probes look (each check reads the dirty log; at 10 ms
/// the looks came every ~12 with their own work, and the 25-ms look at
/// 36 ms).
const CHECK_EVERY: Duration = Duration::from_millis(50);
const PROBE_CHECK_EVERY: Duration = Duration::from_millis(5);
/// One word (64 pages) of the dirty log in this many is a probe.
const PROBE_EVERY: usize = 16;
/// How far past what the link carries in the downtime limit the probes
/// must see the guest write, against their sampling error and a rate of
/// the link that is still rising.
const PROBE_MARGIN: f64 = 2.0;
/// Dirtied probe pages to see before their share counts.
const PROBE_SEEN: u64 = 16;
/// Probes out this long that show the guest writing data at
/// [`SCATTERED_HANDOVER`] of the link's rate (in runs: [`RUNS_HANDOVER`])
/// hand over even where a stop could fit the limit: each page sent
/// meanwhile that the guest rewrites goes twice, and post-copy sends each
/// page once. The sooner the better: a kv guest over 64 MiB at 1 Gbit/s
/// took 0.59 s by post-copy at once, 0.71 by pre-copy alone, 0.98 handed
/// over after the 250 ms look, having sent 40 MB of which most went again,
/// and 0.70 after a 50 ms look. The rate must be [`STEADY`] since half the
/// look: a small hot set, which a short look shows as a fast rate, has it
/// halve as the look doubles (its pages count once), and pre-copy sends it
/// again at little cost (a large one goes sooner: [`HOT_SET_STOP`]).
const PROBE_LOOK: Duration = Duration::from_millis(25);
/// A guest writing scattered pages is handed over by the probes' look
/// only from this share of the link's rate: post-copy costs it a fault on
/// each page it touches first, whose round trips and wake-ups take CPU
/// from the push at both ends, so its post-copy can run well below a link
/// that pre-copy keeps up with (a kv guest at 1.1 times a 10 Gbit/s link
/// over a 32 ms look: post-copy 2.2-2.7 s, pre-copy 1.24, converged in
/// 4-5 iterations under the limit). Nearer the link, the sent runs' longer
/// looks judge.
const SCATTERED_HANDOVER: f64 = FAR_FROM_CONVERGING;
/// A guest dirtying memory at the rate its kind is handed over from
/// ([`SCATTERED_HANDOVER`], in runs [`RUNS_HANDOVER`]) whose probes' pages
/// seen dirty so far would take this share of the downtime limit to send
/// goes from the first look, without waiting for its rate to prove
/// steady: a hot set that large (each later iteration sends it again, and
/// the stop too) is not sent again at little cost. (A kv guest over 64
/// MiB at 1 Gbit/s showed 18-24 MB in its first 10-15 ms, falling from
/// 1.8 GB/s to 1.2 over 25 ms, and went at 35-50 ms, 25-40 ms after
/// post-copy at once.)
const HOT_SET_STOP: f64 = 0.5;
/// Dirtied probe pages read to tell zero pages from data (zeros cost a
/// record, not a page: a guest clearing memory outruns no link).
const ZERO_SAMPLE: usize = 256;
/// Of those holding data, the most compressed to learn what sending one
/// again costs the link: a page with a few words written shrinks to a
/// few hundred bytes, and pre-copy compresses what shrinks (a sparse
/// writer dirtying 1 GB/s of pages costs a 125 MB/s link ~40 MB/s). A
/// codec saving less than [`UNKNOWN_SAVING`] switches itself off: such
/// pages count whole.
const SHARE_SAMPLE: usize = 16;
/// A guest writing in runs is handed over from this share of the link's
/// rate (steadily over [`PROBE_LOOK`]): pre-copy sends what it dirties
/// again, about 1 / (1 − share) of memory's time in all, post-copy each
/// page once, and such a guest asks post-copy for few pages. From a tenth
/// on, pre-copy would take over 1.1 times as long (bwmem over 256 MiB at
/// 10 Gbit/s dirtied 300-570 MB/s under the dirty log: pre-copy 0.39-0.55
/// s, post-copy at once 0.27-0.32).
const RUNS_HANDOVER: f64 = 0.1;
/// A guest writing in runs at [`RUNS_MARGIN`] times [`RUNS_HANDOVER`] of
/// the link's rate is handed over at the first probe look of
/// [`RUNS_LOOK`], without waiting for the rate to prove steady: post-copy
/// costs such a guest few faults, so a hot set taken for a steady rate
/// costs little, while each millisecond of look leaves the destination
/// pages to install before it can take the switch (bwmem over 256 MiB at
/// 10 Gbit/s: a 36-ms look, then 31 ms of the destination catching up,
/// where post-copy at once switched at 26 ms).
const RUNS_LOOK: Duration = Duration::from_millis(10);
const RUNS_MARGIN: f64 = 3.0;

/// Watches a first iteration that sends memory in a strided order (so the
/// pages out so far sample all of memory evenly) for a guest that dirties
/// memory about as fast as the link carries it: then waiting for the
/// iteration to end only sends pages that will be stale again (auto
/// post-copy hands over at once).
pub struct HandoverWatch {
    /// When each run of pages went out: (time, first page, pages).
    sent: Vec<(std::time::Instant, u64, u64)>,
    last_check: std::time::Instant,
    /// What the look that handed over saw: the guest's rate, the link's,
    /// and the look's length.
    seen: Option<(f64, f64, Duration)>,
    /// The downtime limit.
    limit: Duration,
    /// Words of the dirty log cleared when the iteration started, spread
    /// over memory: until sent, their bits show what the guest wrote since
    /// then (a look from the first moment, where sent runs must first be
    /// out a while).
    probes: Vec<usize>,
    probed_at: std::time::Instant,
    /// Per word of the log: sent since the probes were cleared.
    sent_words: Vec<bool>,
    /// The probes' looks so far: (exposure in seconds, rate, pages seen).
    probe_looks: Vec<(f64, f64, u64)>,
    /// The bytes a dirtied page with data costs the link, as a share of
    /// the page: what the last probe look's sample compressed to (1
    /// without a batch codec).
    share: f64,
    /// The last probe look saw the guest write in runs.
    runs: bool,
    /// A probe look of [`RUNS_LOOK`] or longer was taken.
    looked_first: bool,
    /// The share of dirtied pages that hold data, as the last probe look
    /// read them: the sent runs' looks count dirtied pages alone, and a
    /// guest rewriting zeros (a record each) was handed over by them (a 4
    /// GiB fill-zero guest at 1 Gbit/s: "275 MB/s over 250 ms", 0.72 s
    /// where pre-copy took 0.6).
    data_share: f64,
}

/// What a sample of pages shows of the guest's writes.
struct Look {
    /// Pages of the sample dirtied since they went out.
    dirtied: u64,
    /// Bytes of all memory dirtied per second of exposure (for the link:
    /// scaled by what such a page costs it).
    rate: f64,
    /// The sample's mean time out, seconds.
    exposure: f64,
}

impl Look {
    /// `dirtied` of `pages` sampled, out `exposure` seconds on average, of
    /// `pages_total` in all.
    fn new(dirtied: u64, pages: u64, exposure: f64, pages_total: u64) -> Look {
        // The share of the sample dirtied, of all memory, per second.
        let rate = dirtied as f64 / pages.max(1) as f64 * pages_total as f64 * PAGE_SIZE as f64 / exposure.max(1e-6);
        Look { dirtied, rate, exposure }
    }

    fn of_runs(
        sample: &[(std::time::Instant, u64, u64)],
        dirty: &DirtyBitmap,
        now: std::time::Instant,
        pages_total: u64,
    ) -> Look {
        let (mut pages, mut dirtied, mut exposure) = (0u64, 0u64, 0.0);
        for &(at, first, n) in sample {
            pages += n;
            dirtied += (first..first + n).filter(|&p| dirty.get(p)).count() as u64;
            exposure += (now - at).as_secs_f64() * n as f64;
        }
        Look::new(dirtied, pages, exposure / pages.max(1) as f64, pages_total)
    }
}

impl HandoverWatch {
    /// A watch from now, for a migration of this downtime limit.
    pub fn new(limit: Duration) -> HandoverWatch {
        let now = std::time::Instant::now();
        HandoverWatch {
            sent: Vec::new(),
            last_check: now,
            seen: None,
            limit,
            probes: Vec::new(),
            probed_at: now,
            sent_words: Vec::new(),
            probe_looks: Vec::new(),
            share: 1.0,
            runs: false,
            looked_first: false,
            data_share: 1.0,
        }
    }

    /// Picks the probes among the words wholly in `to_send` (so clearing
    /// their dirty bits loses nothing: they go out anyway) and returns
    /// them as a mask over the whole log, to be cleared now.
    pub fn probe(&mut self, to_send: &DirtyBitmap) -> Vec<u64> {
        let words = to_send.words();
        let mut mask = vec![0u64; words.len()];
        self.probes = (0..words.len()).step_by(PROBE_EVERY).filter(|&w| words[w] == u64::MAX).collect();
        for &w in &self.probes {
            mask[w] = u64::MAX;
        }
        self.sent_words = vec![false; words.len()];
        self.probed_at = std::time::Instant::now();
        self.probe_looks.clear();
        mask
    }

    /// `pages` pages from `first` went out now (their dirty bits cleared).
    pub fn sent(&mut self, first: u64, pages: u64) {
        self.sent.push((std::time::Instant::now(), first, pages));
        let words = (first / 64) as usize..(first + pages).div_ceil(64) as usize;
        if let Some(sent) = self.sent_words.get_mut(words) {
            sent.iter_mut().for_each(|w| *w = true);
        }
    }

    /// True when the probes show the guest writing data (not zeros:
    /// `is_zero` reads a page) at [`SCATTERED_HANDOVER`] of the link's rate
    /// over [`PROBE_LOOK`] and steadily since half of it (in runs: at
    /// [`RUNS_HANDOVER`], or after [`RUNS_LOOK`] at [`RUNS_MARGIN`] times
    /// that), or from [`RUNS_LOOK`] on at [`SCATTERED_HANDOVER`] (in runs:
    /// [`RUNS_HANDOVER`]) once the pages seen dirty would take
    /// [`HOT_SET_STOP`] of the limit to send, or sooner at
    /// [`FAR_FROM_CONVERGING`] times it and more than
    /// [`PROBE_MARGIN`] times what the link carries in the downtime limit
    /// (then no iteration can ever end with less than that dirty), or the
    /// pages out for about [`EXPOSURE`] show it dirtying memory at
    /// [`NOT_CONVERGING`] of `link` bytes per second or more, or those out
    /// for about twice [`SHORT_EXPOSURE`] do and the rate is [`STEADY`], or
    /// those out for about [`SHORT_EXPOSURE`] show it at
    /// [`FAR_FROM_CONVERGING`] of it.
    /// `dirty` is a fresh look at the dirty log (KVM's bits stay set until
    /// cleared, so it shows what was written since each run went out);
    /// `peek` fills it and returns false when it cannot look.
    pub fn handover(
        &mut self,
        link: f64,
        pages_total: u64,
        dirty: &mut DirtyBitmap,
        peek: impl FnOnce(&mut DirtyBitmap) -> bool,
        is_zero: impl Fn(u64) -> bool,
        wire_share: impl FnOnce(&[u64]) -> f64,
    ) -> bool {
        let now = std::time::Instant::now();
        let probing = self.probing(now);
        let every = if probing { PROBE_CHECK_EVERY } else { CHECK_EVERY };
        let first_due = probing && !self.looked_first && now - self.probed_at >= RUNS_LOOK;
        if (now - self.last_check < every && !first_due) || link <= 0.0 {
            return false;
        }
        self.last_check = now;
        let short = self.sample(now, SHORT_EXPOSURE);
        if (short.len() < 4 && !probing) || !peek(dirty) {
            return false;
        }
        let limit = self.limit.as_secs_f64();
        let probe = probing.then(|| self.probe_look(dirty, now, pages_total, &is_zero, wire_share));
        if let Some(probe) = &probe {
            self.looked_first |= probe.exposure >= RUNS_LOOK.as_secs_f64();
            self.probe_looks.push((probe.exposure, probe.rate, probe.dirtied));
        }
        let enough = if self.runs { RUNS_HANDOVER } else { SCATTERED_HANDOVER };
        let never_converges = probe.filter(|probe| {
            probe.dirtied >= PROBE_SEEN
                && ((probe.exposure >= PROBE_LOOK.as_secs_f64()
                    && probe.rate >= enough * link
                    && self.steady_since_half(probe))
                    || (self.runs
                        && probe.exposure >= RUNS_LOOK.as_secs_f64()
                        && probe.dirtied >= 2 * PROBE_SEEN
                        && probe.rate >= RUNS_MARGIN * RUNS_HANDOVER * link)
                    || (probe.exposure >= RUNS_LOOK.as_secs_f64()
                        && probe.rate >= enough * link
                        && probe.rate * probe.exposure >= HOT_SET_STOP * link * limit)
                    || (probe.rate >= FAR_FROM_CONVERGING * link
                        && probe.rate * probe.exposure >= PROBE_MARGIN * link * limit))
        });
        let rate = |sample: &[(std::time::Instant, u64, u64)]| {
            if sample.len() >= 4 {
                Look::of_runs(sample, dirty, now, pages_total).rate * self.share * self.data_share
            } else {
                0.0
            }
        };
        let (short_rate, mid_rate, long_rate) =
            (rate(&short), rate(&self.sample(now, 2 * SHORT_EXPOSURE)), rate(&self.sample(now, EXPOSURE)));
        self.seen = if let Some(probe) = never_converges {
            Some((probe.rate, link, Duration::from_secs_f64(probe.exposure)))
        } else if long_rate >= NOT_CONVERGING * link {
            Some((long_rate, link, EXPOSURE))
        } else if mid_rate >= NOT_CONVERGING * link && mid_rate >= STEADY * short_rate {
            Some((mid_rate, link, 2 * SHORT_EXPOSURE))
        } else if short_rate >= FAR_FROM_CONVERGING * link {
            Some((short_rate, link, SHORT_EXPOSURE))
        } else {
            None
        };
        self.seen.is_some()
    }

    /// True until the probes have been out [`RUNS_LOOK`]: the first
    /// iteration sends nothing before, so that a guest the first look
    /// hands over (in runs, far above its share of the link) leaves the
    /// destination no pages to install before it takes the switch
    /// (bwmem over 256 MiB at 10 Gbit/s: the switch 23-74 ms later than
    /// post-copy at once's, 20-40 ms of it pre-copy's pages in flight).
    /// A guest that stays in pre-copy starts 10 ms later.
    /// Only where the link's rate is known (`link`), and at most twice
    /// [`RUNS_LOOK`] where no look can be taken.
    pub fn before_first_look(&self, link: f64) -> bool {
        let now = std::time::Instant::now();
        link > 0.0 && self.probing(now) && !self.looked_first && now - self.probed_at < 2 * RUNS_LOOK
    }

    /// Whether the probes still look: some were cleared, at most the
    /// downtime limit ago.
    fn probing(&self, now: std::time::Instant) -> bool {
        !self.probes.is_empty() && now - self.probed_at <= self.limit
    }

    /// Whether an earlier probe look, over about half of `probe`'s, saw
    /// at least [`STEADY`] of its rate, with pages enough to tell.
    fn steady_since_half(&self, probe: &Look) -> bool {
        let half = probe.exposure / 2.0;
        self.probe_looks
            .iter()
            .filter(|&&(exposure, _, seen)| (0.6 * half..=1.4 * half).contains(&exposure) && seen >= PROBE_SEEN / 2)
            .min_by(|a, b| (a.0 - half).abs().total_cmp(&(b.0 - half).abs()))
            .is_some_and(|&(_, rate, _)| probe.rate >= STEADY * rate)
    }

    /// What the probes not yet sent show: their dirtied pages that hold
    /// data, by the share of a sample of them read, each counted at what
    /// `wire_share` says such a page costs the link (as a share of it) —
    /// unless the guest writes in runs. Such a guest asks post-copy for
    /// few pages (the push, which goes on from the last asked-for page,
    /// keeps ahead of it), so handing it over costs it little and takes
    /// its vCPU off this host's CPUs: its pages count whole (bwmem over
    /// 256 MiB at 1 Gbit/s, compressed 200 times: post-copy at once 0.41
    /// s, pre-copy 0.52), and from [`RUNS_HANDOVER`] of the link's rate.
    /// A scattered writer faults on each page it touches first
    /// (spp-sparse: ~1024 faults a guest loop, 110-160 ms stalls): it is
    /// handed over only if even its compressed pages outrun the link.
    fn probe_look(
        &mut self,
        dirty: &DirtyBitmap,
        now: std::time::Instant,
        pages_total: u64,
        is_zero: impl Fn(u64) -> bool,
        wire_share: impl FnOnce(&[u64]) -> f64,
    ) -> Look {
        let unsent: Vec<usize> = self.probes.iter().copied().filter(|&w| !self.sent_words[w]).collect();
        let dirtied: u64 = unsent.iter().map(|&w| dirty.words()[w].count_ones() as u64).sum();
        // Every step-th dirtied page, in order (no list of them all: this
        // runs every few milliseconds).
        let step = dirtied.div_ceil(ZERO_SAMPLE as u64).max(1) as usize;
        let pages = unsent.iter().flat_map(|&w| {
            let word = dirty.words()[w];
            (0..64u64).filter(move |b| word >> b & 1 == 1).map(move |b| w as u64 * 64 + b)
        });
        let (mut sampled, mut data) = (0u64, Vec::new());
        for page in pages.step_by(step) {
            sampled += 1;
            if !is_zero(page) {
                data.push(page);
            }
        }
        if dirtied >= PROBE_SEEN {
            self.data_share = data.len() as f64 / sampled as f64;
        }
        if !data.is_empty() {
            let every = data.len().div_ceil(SHARE_SAMPLE);
            let sample: Vec<u64> = data.iter().step_by(every).copied().collect();
            let share = wire_share(&sample).clamp(0.001, 1.0);
            self.runs = in_runs(unsent.iter().map(|&w| dirty.words()[w]));
            self.share = if self.runs || share > 1.0 - UNKNOWN_SAVING { 1.0 } else { share };
        }
        let with_data = (dirtied as f64 * data.len() as f64 / sampled.max(1) as f64).round() as u64;
        let mut look =
            Look::new(with_data, unsent.len() as u64 * 64, (now - self.probed_at).as_secs_f64(), pages_total);
        look.rate *= self.share;
        look
    }

    /// Why it handed over, for the summary and the JSON's `choices`.
    pub fn why(&self) -> String {
        match self.seen {
            Some((guest, link, look)) => format!(
                "the guest dirtied memory{} at {:.0} MB/s{} over {} ms of its first iteration, the link carries {:.0} MB/s: \
                 pre-copy would send the pages it rewrites again, post-copy sends each once",
                if self.runs { " in runs" } else { "" },
                guest / self.share / 1e6,
                if self.share < 1.0 { format!(" ({:.0} % of that once compressed)", self.share * 100.0) } else { String::new() },
                look.as_millis(),
                link / 1e6
            ),
            None => "the guest outran the link".into(),
        }
    }

    /// The runs out between one and two `exposure`s ago (all older ones if
    /// those are too few to sample memory).
    fn sample(&self, now: std::time::Instant, exposure: Duration) -> Vec<(std::time::Instant, u64, u64)> {
        let window: Vec<_> = self.sent.iter().filter(|(at, ..)| now - *at >= exposure).copied().collect();
        let recent: Vec<_> = window.iter().filter(|(at, ..)| now - *at < 2 * exposure).copied().collect();
        if recent.len() >= 8 {
            recent
        } else {
            window
        }
    }
}

/// Whether the dirtied pages of these log words lie in runs: a dirtied
/// page's neighbour (in the same word) is dirtied clearly more often than
/// the words' density would have it by chance (half way from it to all).
fn in_runs(words: impl Iterator<Item = u64>) -> bool {
    let (mut dirtied, mut followed, mut slots, mut words_seen) = (0u64, 0u64, 0u64, 0u64);
    for word in words {
        dirtied += word.count_ones() as u64;
        followed += (word & (word >> 1)).count_ones() as u64;
        slots += (word & !(1 << 63)).count_ones() as u64;
        words_seen += 1;
    }
    if slots < PROBE_SEEN {
        return false;
    }
    let density = dirtied as f64 / (64 * words_seen) as f64;
    followed as f64 / slots as f64 >= density + (1.0 - density) / 2.0
}

/// Chunk indices `0..chunks` in bit-reversed order: any first few of
/// them spread evenly over all of memory (0, ½, ¼, ¾, ⅛ …), so what went
/// out so far samples it evenly from the start. (Every 16th chunk in
/// turn did not: its first pass alone took 2 s of a 4 GiB VM at 1 Gbit/s,
/// all of it in low memory, blind to a guest filling high memory.)
pub fn strided(chunks: usize) -> impl Iterator<Item = usize> {
    let bits = chunks.next_power_of_two().trailing_zeros();
    (0..chunks.next_power_of_two())
        .map(move |i| if bits == 0 { 0 } else { i.reverse_bits() >> (usize::BITS - bits) })
        .filter(move |&c| c < chunks)
}

#[cfg(test)]
#[path = "handover_tests.rs"]
mod tests;

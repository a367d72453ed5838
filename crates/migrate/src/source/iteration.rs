//! One pass over a dirty set: every page whose bit is set goes to the
//! pipeline, batch by batch. Pre-copy's iterations run it while the guest
//! runs (the first one perhaps watched for a hand-over to post-copy), and
//! the stop once more with the guest paused.

use std::time::{Duration, Instant};

use tsubame_codec::batch::BatchCodec;
use tsubame_vmm::{memory, DirtyBitmap, PAGE_SIZE};

use super::busy::{PipelineWork, Stopwatch};
use super::error::SourceError;
use super::fetch::{Batch, Fetcher};
use super::handover::{strided, HandoverWatch};
use super::link::Link;
use super::migration::{ms, Migration};
use super::policy::PrecopyPolicy;
use crate::digest::HASHES_HANDED;
use crate::options::MigrateOptions;
use crate::stats::IterationStats;

/// Pages per batch in a stop whose stages run apart: a kv guest's stop
/// took 0.9-1.3 µs a page with these, 1.3-1.9 with 1024-page batches.
const STOP_BATCH_PAGES: u64 = 128;

/// The most link time a batch of a watched first iteration takes, where
/// the link's rate is known: what is queued when the watch hands over goes
/// out before the switch, and most of it the guest rewrites (1024-page
/// batches, 32 ms each at 1 Gbit/s, kept a kv guest's switch 50 ms behind
/// the look that decided it). Smaller batches cost work per batch: at 10
/// Gbit/s 256-page ones made a kv guest's first iteration 36 % longer.
const WATCHED_BATCH_TIME: Duration = Duration::from_millis(10);

/// The least dirty pages of a stop whose stages run apart
/// ([`super::engine::Engine::spread_stages`]): four batches.
const SPREAD_STOP_PAGES: u64 = 4 * STOP_BATCH_PAGES;

/// How far ahead of the link the watched first iteration reads pages
/// (beyond the round trip; a batch of 4 MiB takes ~2 ms to fetch and
/// encode here), and the longest it waits for the link at a time.
const LINK_LEAD: Duration = Duration::from_millis(10);
const LINK_WAIT: Duration = Duration::from_millis(100);
/// How long an uncapped link's rate is measured before a look trusts it:
/// what went out in the first tens of milliseconds (while the iteration
/// starts) had a small kv guest handed over on a link it keeps up with.
const LINK_MEASURED: Duration = Duration::from_millis(100);
/// How long it waits for the link between two looks at the guest.
const LOOK_STEP: Duration = Duration::from_millis(5);
/// How long it sleeps between looks until the first look is due.
const FIRST_LOOK_STEP: Duration = Duration::from_millis(1);

/// Which pass [`send_dirty`] makes.
pub(super) enum Pass<'a> {
    /// An iteration while the guest runs, under pre-copy's `policy` (the
    /// guest's throttle; a first look at the link while none is known),
    /// perhaps with auto post-copy's `watch`.
    Running { policy: &'a mut PrecopyPolicy, watch: Option<HandoverWatch> },
    /// The stop's, with the guest paused at `throttle` (auto-converge's).
    Paused { throttle: f64 },
}

/// Sends every page whose bit is set, clearing each batch's bits in KVM
/// right before reading it. With a watch it visits memory in a strided
/// order and stops early when the watch says hand over; then it also
/// returns the pages it did not send. Paused (the stop) it hands the
/// digest each page it read with its hash and asks for the digest
/// ([`Sent::digest`]), and clears no dirty bits ([`Fetcher::paused`]).
pub(super) fn send_dirty(
    m: &mut Migration,
    link: &mut Link,
    bitmap: &DirtyBitmap,
    iteration: u32,
    pass: Pass,
) -> Result<Sent, SourceError> {
    let (paused, throttle, mut policy, mut watch) = match pass {
        Pass::Running { policy, watch } => (false, policy.auto_converge.fraction, Some(policy), watch),
        Pass::Paused { throttle } => (true, throttle, None, None),
    };
    let vm = m.vm;
    let started = Instant::now();
    let bytes_before = link.engine().bytes();
    let work_before = link.engine().work();
    let dirty_pages = bitmap.count();
    let mut it = IterationStats { index: iteration, dirty_pages, throttle, ..Default::default() };
    let layout = link.engine().layout();
    let held = std::mem::replace(&mut m.held_nonzero, DirtyBitmap::new(0));
    let mut fetcher = Fetcher::new(layout.batch_pages as usize, held, m.options.codecs.zero, m.options.zero_copy);
    fetcher.far = m.far_filter().cloned();
    // Running, the fetch hashes each page it copies (still in cache) and
    // hands the hashes over in chunks: the digest thread had read each
    // again, a copy and a hash beside the guest (a ninth of the source's
    // CPU in spp-sparse's migration, 41 ms of its last 150). Not for
    // far memory or zero-copy, whose pages the fetch does not all read.
    let hands_hashes = !paused && m.far.is_none() && !m.options.zero_copy;
    let feed = hands_hashes.then(|| {
        m.digest().await_hashes(bitmap.clone());
        m.digest().feed()
    });
    fetcher.hashes = (paused || hands_hashes).then(Vec::new);
    fetcher.paused = paused;
    let mut remaining = dirty_pages;
    // A stop with pages enough runs its stages side by side, on
    // batches small enough that the encoders start early and finish
    // soon after the fetch (a 1024-page batch was fetched whole before
    // its encoding began). A few pages gain less than moving the
    // threads costs (0.04 ms).
    let spread = paused && dirty_pages >= SPREAD_STOP_PAGES;
    let batch_pages = if spread {
        STOP_BATCH_PAGES.min(layout.batch_pages)
    } else if let (Some(_), Some(cap)) = (&watch, link.rate.known()) {
        // What a page with data costs the link: pages that shrink take
        // less of it each, and batches of them as much link time hold
        // more (a sparse 1 GiB guest at 1 Gbit/s, whose pages shrink ~50
        // times: its watched first iteration took 0.77 s in 256-page
        // batches, 0.55 in 1024-page ones, 0.45 unwatched).
        let page_bytes = PAGE_SIZE as f64 * memory_share(vm.memory(), m.options.codecs.batch);
        let pages = (cap * WATCHED_BATCH_TIME.as_secs_f64() / page_bytes) as u64;
        (pages / 64 * 64).clamp(64, layout.batch_pages)
    } else {
        layout.batch_pages
    };
    if spread {
        link.engine().spread_stages();
    }
    let chunks: Vec<(u64, &[u64])> = bitmap.chunks((batch_pages / 64) as usize).collect();
    let order: Vec<usize> = if watch.is_some() { strided(chunks.len()).collect() } else { (0..chunks.len()).collect() };
    // Only a watch looks (a bitmap of all memory per stop cost it
    // faults).
    let mut peek = if watch.is_some() { vm.dirty_bitmap() } else { DirtyBitmap::new(0) };
    if let Some(watch) = &mut watch {
        vm.clear_dirty_log(0, &watch.probe(bitmap))?;
    }
    let mut unsent = None;
    // A batch takes the next runs' pages while they fit and are the
    // same shard's: runs of zeros the destination holds already add
    // none, and a batch per run cost a hand-off to the encoder each
    // (~0.2 s per 4 GiB of such runs with 2 busy cores).
    let mut open: Option<Batch> = None;
    // The fetch's work since its last wait, timed by stretch, not by
    // run: each look at the thread's CPU clock is a system call (0.36
    // µs here), six per run took ~0.5 ms of a kv guest's stop.
    let mut stretch = Stopwatch::start();
    for (done, &c) in order.iter().enumerate() {
        let (first_page, chunk) = chunks[c];
        if chunk.iter().all(|&w| w == 0) {
            continue;
        }
        if let Some(watch) = &mut watch {
            // It reads pages only shortly before the link takes them
            // (what is in flight when it hands over goes stale before
            // it lands, and delays the switch), and looks at the guest
            // while it waits: a look only between batches came 100 ms
            // late for a guest dirtying 1.6 GB/s against 1 Gbit/s.
            link.engine().fetched(stretch.elapsed());
            let waiting = Instant::now();
            let handed = loop {
                // What the link carries: the cap where one is known
                // (early on the sockets' buffers take more than it, or
                // less while the iteration starts), else what went out,
                // once that says something (no look before: 0).
                let elapsed = started.elapsed();
                let written = (link.engine().bytes() - bytes_before) as f64 / elapsed.as_secs_f64();
                let measured = if elapsed < LINK_MEASURED { 0.0 } else { written };
                let link_rate = link.rate.known_or(measured);
                let is_zero = |page| memory::page_is_zero(vm.memory(), page);
                let wire_share = |pages: &[u64]| compressed_share(vm.memory(), m.options.codecs.batch, pages);
                if watch.handover(
                    link_rate,
                    m.stats.pages_total,
                    &mut peek,
                    |b| vm.peek_dirty_log(b).unwrap_or(false),
                    is_zero,
                    wire_share,
                ) {
                    break true;
                }
                if watch.before_first_look(link_rate) {
                    // Nothing goes before the first look: a guest it hands
                    // over then leaves no pages in flight to install
                    // before the switch.
                    std::thread::sleep(FIRST_LOOK_STEP);
                    continue;
                }
                let step = LINK_WAIT.saturating_sub(waiting.elapsed()).min(LOOK_STEP);
                if link.engine().wait_for_link(link_rate, LINK_LEAD, step) || step < LOOK_STEP {
                    break false;
                }
            };
            stretch = Stopwatch::start();
            if handed {
                // What is left of this iteration goes with post-copy.
                let mut left = DirtyBitmap::new(bitmap.pages());
                for &(first, words) in order[done..].iter().map(|&c| &chunks[c]) {
                    let end = (first / 64) as usize + words.len();
                    left.words_mut()[(first / 64) as usize..end].copy_from_slice(words);
                }
                unsent = Some((left, watch.why()));
                break;
            }
        }
        let picked = fetcher.pick(vm, first_page, chunk)?;
        if picked > 0 {
            let shard = layout.shard(first_page);
            let mut batch = match open.take() {
                Some(batch) if batch.shard == shard && batch.len() + picked <= batch_pages as usize => batch,
                full => {
                    // Handing a batch on and taking a free one may wait.
                    link.engine().fetched(stretch.elapsed());
                    if let Some(batch) = full {
                        link.engine().submit(batch)?;
                    }
                    let mut batch = link.engine().take_batch()?;
                    batch.clear(iteration, shard, false);
                    stretch = Stopwatch::start();
                    batch
                }
            };
            fetcher.fill(vm, &mut batch)?;
            if let (Some(feed), Some(hashes)) = (&feed, &mut fetcher.hashes) {
                if hashes.len() >= HASHES_HANDED {
                    feed.known(std::mem::take(hashes));
                }
            }
            open = Some(batch);
        }
        if let Some(watch) = &mut watch {
            watch.sent(first_page, chunk.len() as u64 * 64);
        }
        remaining = remaining.saturating_sub(chunk.iter().map(|w| w.count_ones() as u64).sum::<u64>());
        if let Some(policy) = &mut policy {
            look_at_link(policy, m.options, link, started, bytes_before, &work_before);
        }
        let wire_bytes = link.engine().bytes();
        m.progress.update(|p| {
            p.remaining_pages = remaining;
            p.dirty_pages = dirty_pages;
            p.bytes_on_wire = wire_bytes;
        });
    }
    link.engine().fetched(stretch.elapsed());
    if let Some(batch) = open {
        link.engine().submit(batch)?;
    }
    if let Some(feed) = &feed {
        feed.known(fetcher.hashes.take().unwrap_or_default());
    }
    // The stop: from here this thread does little work (the digest's
    // bookkeeping below), then waits and writes frames until RESUMED:
    // it runs first whenever it is ready (see [`super::stop::Stop`]).
    let realtime = paused.then(tsubame_vmm::cpu_time::realtime_thread);
    m.held_nonzero = std::mem::replace(&mut fetcher.held_nonzero, DirtyBitmap::new(0));
    // The stop: every last page is read and hashed, so the digest
    // takes them now and answers while the pipeline drains (asked
    // after STATE, its thread took 0.2-0.6 ms to wake and answer).
    let digest = fetcher.hashes.is_some().then(|| {
        // Pages read come with their hashes and are not marked: a
        // mark would start the digest thread reading them again.
        let (hashes, unread) = fetcher.stop_hashes(bitmap);
        m.digest().mark_pages(unread);
        m.digest().feed().known(hashes);
        m.digest().request_hashes_in_stop()
    });
    it.pages_sent = link.engine().end_iteration(iteration)?;
    it.bytes_on_wire = link.engine().bytes() - bytes_before;
    it.duration_ms = ms(started.elapsed());
    let work = link.engine().work() - work_before;
    let fetch = work.fetch - fetcher.bookkeeping;
    it.work_ms = ms(fetch.wall + work.encode.wall);
    it.work_cpu_ms = ms(fetch.cpu + work.encode.cpu);
    it.send_ms = ms(work.send.wall);
    m.stats.pages_sent += it.pages_sent;
    m.stats.bytes_on_wire = link.engine().bytes();
    m.stats.iterations = iteration + 1;
    Ok(Sent { it, unsent, zeros: fetcher.zeros, hashed: hands_hashes, digest, realtime })
}

/// While no iteration has measured the link, a look at it from the one
/// in progress once it has gone [`LINK_MEASURED`] and sent enough to tell
/// ([`PrecopyPolicy::first_look`]), for the codecs. Called per chunk: the
/// senders' busy time is read only once there is a look to take (an idle
/// 4 GiB guest's first iteration sends under a MiB).
fn look_at_link(
    policy: &mut PrecopyPolicy,
    options: &MigrateOptions,
    link: &mut Link,
    started: Instant,
    bytes_before: u64,
    work_before: &PipelineWork,
) {
    let elapsed = started.elapsed();
    if elapsed < LINK_MEASURED || policy.codec_link_rate(options) > 0.0 {
        return;
    }
    let bytes = link.engine().bytes() - bytes_before;
    if !PrecopyPolicy::enough_for_a_look(bytes) {
        return;
    }
    let send = link.engine().work().send.wall - work_before.send.wall;
    policy.first_look(bytes, ms(elapsed), ms(send));
    link.set_capacity(policy.codec_link_rate(options));
}

/// What `pages` compress to with `codec`, as a share of their bytes (1
/// without a codec, or where a page cannot be read).
fn compressed_share(mem: &memory::GuestMemory, codec: Option<BatchCodec>, pages: &[u64]) -> f64 {
    let Some(codec) = codec else { return 1.0 };
    let mut input = vec![0u8; pages.len() * PAGE_SIZE];
    for (chunk, &page) in input.chunks_exact_mut(PAGE_SIZE).zip(pages) {
        let chunk: &mut [u8; PAGE_SIZE] = chunk.try_into().expect("chunks of a page");
        if memory::read_page(mem, page, chunk).is_err() {
            return 1.0;
        }
    }
    let mut out = Vec::new();
    codec.compress(&input, &mut out);
    (out.len() as f64 / input.len().max(1) as f64).min(1.0)
}

/// Pages of memory [`memory_share`] looks at, spread evenly, and of
/// those holding data how many it compresses.
const MEMORY_LOOKS: u64 = 256;
const MEMORY_SAMPLE: usize = 16;

/// The share of its size a page of memory holding data takes on the wire
/// under `codec`, from a sample spread over memory (1 without a codec;
/// the least, 1/64, where none holds data: zero pages and pages never
/// populated cost a record each, and a 4 GiB guest of zeros took 4096
/// watched batches, each a hand-off and a look). Pages never populated
/// are not read (a read would map them, and the fetch then reads them as
/// zeros).
fn memory_share(mem: &memory::GuestMemory, codec: Option<BatchCodec>) -> f64 {
    const LEAST: f64 = 1.0 / 64.0;
    let (Some(_), Ok(pagemap)) = (codec, memory::Pagemap::open()) else { return 1.0 };
    let pages = memory::page_count(mem);
    let step = (pages / MEMORY_LOOKS).max(1);
    let mut populated = [false];
    let mut holds_data = |page: u64| {
        pagemap.populated(mem, page, &mut populated).is_ok() && populated[0] && !memory::page_is_zero(mem, page)
    };
    let sample: Vec<u64> = (0..pages).step_by(step as usize).filter(|&p| holds_data(p)).take(MEMORY_SAMPLE).collect();
    if sample.is_empty() {
        return LEAST;
    }
    compressed_share(mem, codec, &sample).max(LEAST)
}

/// What one pass of [`send_dirty`] did.
pub(super) struct Sent {
    /// The iteration's figures.
    pub it: IterationStats,
    /// Handed over to post-copy: the pages not sent, and why.
    pub unsent: Option<(DirtyBitmap, String)>,
    /// The pages it found all zeros (for the digest; none when `paused`:
    /// the digest has them).
    pub zeros: DirtyBitmap,
    /// The digest has the hash of every page read (only the zeros are
    /// left to hand over); else it must read the pages sent.
    pub hashed: bool,
    /// With `paused`: the digest's region hashes with every page read,
    /// on their way.
    pub digest: Option<crossbeam_channel::Receiver<Vec<u64>>>,
    /// With `paused`: the thread runs under SCHED_FIFO from the last
    /// page read until this drops.
    pub realtime: Option<tsubame_vmm::cpu_time::Realtime>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_share_is_what_a_sample_of_pages_with_data_compresses_to() {
        let memory = memory::create(8 << 20, false).unwrap();
        // Nothing populated, or zeros alone: a record a page.
        assert_eq!(memory_share(&memory, Some(BatchCodec::Lz4)), 1.0 / 64.0);
        memory::populate(&memory, 0, memory::page_count(&memory));
        assert_eq!(memory_share(&memory, Some(BatchCodec::Lz4)), 1.0 / 64.0);
        // A word in every page: lz4 shrinks such pages many times.
        for page in 0..memory::page_count(&memory) {
            memory::write(&memory, page * PAGE_SIZE as u64 + 64, &page.to_le_bytes()).unwrap();
        }
        let sparse = memory_share(&memory, Some(BatchCodec::Lz4));
        assert!(sparse < 0.1, "{sparse}");
        assert_eq!(memory_share(&memory, None), 1.0);
        // Random bytes do not shrink.
        let mut x = 1u64;
        for page in 0..memory::page_count(&memory) {
            let bytes: Vec<u8> = (0..PAGE_SIZE / 8)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()
                })
                .collect();
            memory::write(&memory, page * PAGE_SIZE as u64, &bytes).unwrap();
        }
        assert!(memory_share(&memory, Some(BatchCodec::Lz4)) > 0.9);
    }
}

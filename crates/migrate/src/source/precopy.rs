//! Pre-copy: iterations over the dirty set while the guest runs, until
//! the policy says stop, or hand over to post-copy ([`super::policy`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use tsubame_vmm::{memory, DirtyBitmap};

use super::busy::Stopwatch;
use super::choices::postcopy_choice;
use super::fetch::{Batch, Fetcher};
use super::handover::{strided, HandoverWatch};
use super::link::LinkRate;
use super::policy::{Decision, Handover};
use super::send::{DRAINED, DRAIN_LIMIT};
use super::{ms, PrecopyEnd, SourceError, SourceRun};
use crate::digest;
use crate::options::PostcopyMode;
use crate::protocol::{Digest, FrameKind, SourceState};
use crate::stats::{IterationStats, StopReason};

/// Unhashed pages (4 MiB) above which a converged pre-copy lets the
/// digest catch up before it pauses the guest: hashing in the downtime ran
/// at ~8 GB/s on this 2-core host (4 GiB in 508 ms), so less than this
/// costs the downtime under a millisecond.
const DIGEST_LAG_PAGES: u64 = 1024;

/// Pages per batch in a stop whose stages run apart: a kv guest's stop
/// took 0.9-1.3 µs a page with these, 1.3-1.9 with 1024-page batches.
const STOP_BATCH_PAGES: u64 = 128;

/// The most link time a batch of a watched first iteration takes, where
/// the link's rate is known: what is queued when the watch hands over goes
/// out before the switch, and most of it the guest rewrites (1024-page
/// batches, 32 ms each at 1 Gbit/s, kept a kv guest's switch 50 ms behind
/// the look that decided it). Smaller batches cost work per batch: at 10
/// Gbit/s 256-page ones made a kv guest's first iteration 36 % longer.
const WATCHED_BATCH_TIME: std::time::Duration = std::time::Duration::from_millis(10);

/// The least dirty pages of a stop whose stages run apart
/// ([`super::engine::Engine::spread_stages`]): four batches.
const SPREAD_STOP_PAGES: u64 = 4 * STOP_BATCH_PAGES;

/// The most dirty pages of a stop whose stages run in turn on the
/// migration thread ([`super::engine::Engine::run_in_turn`]): a few
/// pages' hand-offs to other threads cost more than the work on them
/// (gmigrate-best's stops of 2-23 pages), while 489 whole pages at 1
/// Gbit/s took 1.99 ms in turn against 0.84 in threads (demo, kv).
pub(super) const IN_TURN_STOP_PAGES: u64 = 64;

/// How many times the last look before a converged stop may go back to
/// one more iteration (each sends the digest and drains the link anew).
const LAST_LOOKS: u32 = 2;

/// How far ahead of the link the watched first iteration reads pages
/// (beyond the round trip; a batch of 4 MiB takes ~2 ms to fetch and
/// encode here), and the longest it waits for the link at a time.
const LINK_LEAD: std::time::Duration = std::time::Duration::from_millis(10);
const LINK_WAIT: std::time::Duration = std::time::Duration::from_millis(100);
/// How long an uncapped link's rate is measured before a look trusts it:
/// what went out in the first tens of milliseconds (while the iteration
/// starts) had a small kv guest handed over on a link it keeps up with.
const LINK_MEASURED: std::time::Duration = std::time::Duration::from_millis(100);
/// How long it waits for the link between two looks at the guest.
const LOOK_STEP: std::time::Duration = std::time::Duration::from_millis(5);

impl SourceRun<'_> {
    /// Iterations while the guest runs; returns with the VM still running,
    /// and the pages still dirty in `self.pending` or in what post-copy is
    /// handed.
    pub(super) fn precopy(&mut self) -> Result<PrecopyEnd, SourceError> {
        let vm = self.vm;
        let mut bitmap = vm.dirty_bitmap();
        vm.set_dirty_logging(true)?;
        if let Some((_, far)) = &self.far_map {
            // Far memory kept the log on since boot: it holds only what
            // changed lately, not every page. Every page but the far ones,
            // which live on the memory host the destination attaches to.
            bitmap.set_all();
            bitmap.words_mut().iter_mut().zip(far.far.words()).for_each(|(b, f)| *b &= !f);
        } else if vm.manual_dirty_protect() {
            vm.dirty_log(&mut bitmap)?; // all ones: logging just started
        } else {
            bitmap.set_all();
        }
        if self.options.postcopy == PostcopyMode::After(0) {
            self.chose_postcopy(Handover::After(0).why());
            return Ok(PrecopyEnd::Postcopy { missing: bitmap, last_iteration: None });
        }
        let mut iteration = 0u32;
        // Whether the digest caught up before the stop once already.
        let mut caught_up = false;
        // Last looks that found too much dirty to stop.
        let mut last_looks = 0;
        loop {
            self.progress.update(|p| p.iteration = iteration);
            // Auto post-copy watches the first iteration, sent in a strided
            // order, for a guest that outruns the link.
            // (With auto-converge the throttle gets its chance first.)
            let watch = (iteration == 0 && self.options.postcopy == PostcopyMode::Auto && !self.options.auto_converge)
                .then(|| HandoverWatch::new(self.options.downtime_limit));
            let Sent { it, unsent, zeros, .. } = self.send_dirty(&bitmap, iteration, watch, false)?;
            if let Some((unsent, why)) = unsent {
                self.chose_postcopy(why);
                // Post-copy's senders hash the pages left (the digest would
                // read them a second time: 4 GiB of fill-random, beside the
                // switch); the digest hashes those sent.
                self.digest().await_hashes(unsent.clone());
                let mut sent = bitmap.clone();
                sent.subtract(&unsent);
                self.digest().mark_read(sent, Some(zeros));
                self.stats.per_iteration.push(it);
                return Ok(PrecopyEnd::Postcopy { missing: unsent, last_iteration: Some(iteration) });
            }
            self.refresh_digest(&bitmap, Some(zeros));
            let bw = self.policy.observe(&it, self.options);
            let summary = self.engine.as_ref().map_or_else(String::new, |e| e.summary());
            self.progress.update(|p| {
                p.bandwidth = bw;
                p.pipeline = summary;
            });
            self.bandwidth.store(bw.to_bits(), Ordering::Relaxed);
            self.stats.per_iteration.push(it.clone());
            iteration += 1;
            if iteration == 1 {
                // The bulk of memory is across: the disk cache's contents
                // next, before the dirty log says how much is left.
                self.send_warm_data()?;
            }

            vm.dirty_log(&mut bitmap)?;
            self.send_disk_written()?;
            if let Some(rtt) = self.engine().round_trip() {
                self.policy.round_trip = rtt;
            }
            let remaining = bitmap.count();
            self.stats.expected_downtime_ms = ms(self.policy.expected(remaining, self.options));
            let decision = self.policy.decide(
                &it,
                remaining,
                iteration,
                self.stats.bytes_on_wire,
                vm.memory_bytes(),
                self.options,
            );
            let reason = match decision {
                Decision::Continue { throttle } => {
                    if let Some(fraction) = throttle {
                        vm.set_throttle(fraction);
                    }
                    continue;
                }
                Decision::Postcopy(why) => {
                    self.chose_postcopy(why.why());
                    return Ok(PrecopyEnd::Postcopy { missing: bitmap, last_iteration: Some(iteration - 1) });
                }
                Decision::Stop(reason) if reason.converged() && !caught_up && self.digest_lags() => {
                    caught_up = true;
                    // Hash the backlog while the guest still runs (in the
                    // downtime it took 0.3-0.8 s for a 4 GiB VM that
                    // converged in two quick iterations), then send what it
                    // dirtied meanwhile in one more iteration.
                    self.enter(SourceState::HashingBeforeStop);
                    let _ = self.digest.as_ref().map(|d| d.hashes());
                    self.enter(SourceState::Iterating);
                    vm.add_dirty_log(&mut bitmap)?;
                    continue;
                }
                Decision::Stop(reason) if reason.converged() => {
                    // The digest as it stands goes now (the stop sends only
                    // the regions that change), and what is queued in the
                    // link goes out while the guest still runs: the
                    // destination checks the digest only after it.
                    self.send_digest_before_stop()?;
                    // Then the last look: what the guest dirtied meanwhile
                    // joins the stop, and the expected downtime counts it
                    // (a kv guest at 10 Gbit/s dirtied 1584 pages in those
                    // few milliseconds, after a look that left almost none).
                    vm.add_dirty_log(&mut bitmap)?;
                    let now = bitmap.count();
                    self.stats.expected_downtime_ms = ms(self.policy.expected(now, self.options));
                    if !self.policy.grew_too_much(remaining, now, self.options) {
                        reason
                    } else if last_looks < LAST_LOOKS {
                        last_looks += 1;
                        continue;
                    } else if self.policy.expected(now, self.options) <= self.options.downtime_limit {
                        reason
                    } else if self.options.postcopy == PostcopyMode::Auto {
                        // Pre-copy converges only with a stop that fits the
                        // limit: post-copy where allowed, else more
                        // iterations until one fits or there were enough.
                        let expected = self.policy.expected(now, self.options);
                        let limit = self.options.downtime_limit;
                        self.chose_postcopy(Handover::OverLimit { expected, limit }.why());
                        return Ok(PrecopyEnd::Postcopy { missing: bitmap, last_iteration: Some(iteration - 1) });
                    } else if iteration < self.options.max_iterations {
                        continue;
                    } else {
                        StopReason::MaxIterations
                    }
                }
                Decision::Stop(reason) => reason,
            };
            self.stats.stop_reason = reason;
            if reason.converged() && self.options.postcopy != PostcopyMode::Off {
                let why = match reason {
                    StopReason::NoDirtyPages => "pre-copy left nothing dirty".to_string(),
                    _ => format!("pre-copy converged in {iteration} iteration(s)"),
                };
                postcopy_choice(&mut self.stats.choices, "not needed".into(), why);
            }
            self.stats.converged = reason.converged();
            if !reason.converged() && self.options.abort_if_not_converged {
                return Err(SourceError::NotConverged(reason.name().into()));
            }
            // Without manual protect, `bitmap` was cleared in KVM: keep
            // it for stop-and-copy, which adds what comes after.
            self.pending = Some(bitmap);
            return Ok(PrecopyEnd::StopAndCopy);
        }
    }

    /// Sends the digest as it stands (a later DIGEST replaces it) and lets
    /// the link's queue drain.
    fn send_digest_before_stop(&mut self) -> Result<(), SourceError> {
        if let Some(hashes) = self.digest.as_ref().map(|d| d.hashes()) {
            let digest = Digest { region: self.options.digest_region, hashes };
            self.write_control(FrameKind::Digest, &digest.encode())?;
            self.digest_sent = Some(digest.hashes);
        }
        self.engine().drain(DRAINED, DRAIN_LIMIT);
        Ok(())
    }

    /// Whether the memory digest has so much left to hash that doing it
    /// during the downtime would matter.
    fn digest_lags(&self) -> bool {
        self.digest.as_ref().is_some_and(|d| d.backlog_pages() > DIGEST_LAG_PAGES)
    }

    /// Hands the pages just sent to the digest thread, which hashes them
    /// (all memory the first time) while the next iteration runs; those
    /// the fetch found all zeros (`zeros`, of the same send) it need not read.
    pub(super) fn refresh_digest(&mut self, sent: &DirtyBitmap, zeros: Option<DirtyBitmap>) {
        self.digest().mark_read(sent.clone(), zeros);
    }

    /// The source's digest, started (every page to hash) the first time.
    pub(super) fn digest(&mut self) -> &digest::BackgroundDigest {
        let vm = self.vm;
        self.digest.get_or_insert_with(|| {
            let far = self.far_map.as_ref().map(|(_, far)| far.clone());
            digest::BackgroundDigest::start(vm.memory().clone(), self.options.digest_region, far)
        })
    }

    /// Settles the post-copy choice: handed over now, for `why`.
    fn chose_postcopy(&mut self, why: String) {
        let chose = format!("switched at {:.2} s", self.start.elapsed().as_secs_f64());
        postcopy_choice(&mut self.stats.choices, chose, why);
    }

    /// Sends every page whose bit is set, clearing each batch's bits in KVM
    /// right before reading it. With a `watch` it visits memory in a
    /// strided order and stops early when the watch says hand over; then
    /// it also returns the pages it did not send. With `paused` (the stop)
    /// it hands the digest each page it read with its hash and asks for
    /// the digest ([`Sent::digest`]), and clears no dirty bits
    /// ([`Fetcher::paused`]).
    pub(super) fn send_dirty(
        &mut self,
        bitmap: &DirtyBitmap,
        iteration: u32,
        mut watch: Option<HandoverWatch>,
        paused: bool,
    ) -> Result<Sent, SourceError> {
        let vm = self.vm;
        let started = Instant::now();
        let bytes_before = self.engine().bytes();
        let work_before = self.engine().work();
        let dirty_pages = bitmap.count();
        let throttle = self.policy.auto_converge.fraction;
        let mut it = IterationStats { index: iteration, dirty_pages, throttle, ..Default::default() };
        let layout = self.engine().layout();
        let held = std::mem::replace(&mut self.held_nonzero, DirtyBitmap::new(0));
        let mut fetcher =
            Fetcher::new(layout.batch_pages as usize, held, self.options.codecs.zero, self.options.zero_copy);
        fetcher.far = self.far_filter.clone();
        fetcher.hashes = paused.then(Vec::new);
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
        } else if let (Some(_), Some(cap)) = (&watch, LinkRate::of(self.options).known()) {
            let pages = (cap * WATCHED_BATCH_TIME.as_secs_f64()) as u64 / tsubame_vmm::PAGE_SIZE as u64;
            (pages / 64 * 64).clamp(64, layout.batch_pages)
        } else {
            layout.batch_pages
        };
        if spread {
            self.engine().spread_stages();
        }
        let chunks: Vec<(u64, &[u64])> = bitmap.chunks((batch_pages / 64) as usize).collect();
        let order: Vec<usize> =
            if watch.is_some() { strided(chunks.len()).collect() } else { (0..chunks.len()).collect() };
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
                self.engine().fetched(stretch.elapsed());
                let waiting = Instant::now();
                let handed = loop {
                    // What the link carries: the cap where one is known
                    // (early on the sockets' buffers take more than it, or
                    // less while the iteration starts), else what went out,
                    // once that says something (no look before: 0).
                    let elapsed = started.elapsed();
                    let written = (self.engine().bytes() - bytes_before) as f64 / elapsed.as_secs_f64();
                    let measured = if elapsed < LINK_MEASURED { 0.0 } else { written };
                    let link = LinkRate::of(self.options).known_or(measured);
                    let is_zero = |page| memory::page_is_zero(vm.memory(), page);
                    if watch.handover(
                        link,
                        self.stats.pages_total,
                        &mut peek,
                        |b| vm.peek_dirty_log(b).unwrap_or(false),
                        is_zero,
                    ) {
                        break true;
                    }
                    let step = LINK_WAIT.saturating_sub(waiting.elapsed()).min(LOOK_STEP);
                    if self.engine().wait_for_link(link, LINK_LEAD, step) || step < LOOK_STEP {
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
                        self.engine().fetched(stretch.elapsed());
                        if let Some(batch) = full {
                            self.engine().submit(batch)?;
                        }
                        let mut batch = self.engine().take_batch()?;
                        batch.clear(iteration, shard, false);
                        stretch = Stopwatch::start();
                        batch
                    }
                };
                fetcher.fill(vm, &mut batch)?;
                open = Some(batch);
            }
            if let Some(watch) = &mut watch {
                watch.sent(first_page, chunk.len() as u64 * 64);
            }
            let engine = self.engine();
            remaining = remaining.saturating_sub(chunk.iter().map(|w| w.count_ones() as u64).sum::<u64>());
            let wire_bytes = engine.bytes();
            self.progress.update(|p| {
                p.remaining_pages = remaining;
                p.dirty_pages = dirty_pages;
                p.bytes_on_wire = wire_bytes;
            });
        }
        self.engine().fetched(stretch.elapsed());
        if let Some(batch) = open {
            self.engine().submit(batch)?;
        }
        // The stop: from here this thread does little work (the digest's
        // bookkeeping below), then waits and writes frames until RESUMED:
        // it runs first whenever it is ready (see `stop_and_copy`).
        let realtime = paused.then(tsubame_vmm::cpu_time::realtime_thread);
        self.held_nonzero = std::mem::replace(&mut fetcher.held_nonzero, DirtyBitmap::new(0));
        // The stop: every last page is read and hashed, so the digest
        // takes them now and answers while the pipeline drains (asked
        // after STATE, its thread took 0.2-0.6 ms to wake and answer).
        let digest = fetcher.hashes.is_some().then(|| {
            // Pages read come with their hashes and are not marked: a
            // mark would start the digest thread reading them again.
            let (hashes, unread) = fetcher.stop_hashes(bitmap);
            self.digest().mark_pages(unread);
            self.digest().feed().known(hashes);
            self.digest().request_hashes_in_stop()
        });
        it.pages_sent = self.engine().end_iteration(iteration)?;
        it.bytes_on_wire = self.engine().bytes() - bytes_before;
        it.duration_ms = ms(started.elapsed());
        let work = self.engine().work() - work_before;
        let fetch = work.fetch - fetcher.bookkeeping;
        it.work_ms = ms(fetch.wall + work.encode.wall);
        it.work_cpu_ms = ms(fetch.cpu + work.encode.cpu);
        it.send_ms = ms(work.send.wall);
        self.stats.pages_sent += it.pages_sent;
        self.stats.bytes_on_wire = self.engine().bytes();
        self.stats.iterations = iteration + 1;
        Ok(Sent { it, unsent, zeros: fetcher.zeros, digest, realtime })
    }
}

/// What one pass of [`SourceRun::send_dirty`] did.
pub(super) struct Sent {
    /// The iteration's figures.
    pub it: IterationStats,
    /// Handed over to post-copy: the pages not sent, and why.
    pub unsent: Option<(DirtyBitmap, String)>,
    /// The pages it found all zeros (for the digest; none when `paused`:
    /// the digest has them).
    pub zeros: DirtyBitmap,
    /// With `paused`: the digest's region hashes with every page read,
    /// on their way.
    pub digest: Option<crossbeam_channel::Receiver<Vec<u64>>>,
    /// With `paused`: the thread runs under SCHED_FIFO from the last
    /// page read until this drops.
    pub realtime: Option<tsubame_vmm::cpu_time::Realtime>,
}

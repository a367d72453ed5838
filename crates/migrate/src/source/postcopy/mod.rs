//! Post-copy (as QEMU's postcopy-ram): instead of a long stop-and-copy the
//! source pauses its VM and hands it to the destination, which runs it at
//! once without the pages it lacks and asks for each one its guest
//! touches; the source sends asked-for pages first, on a connection of
//! their own, and pushes the rest in the background, next to the last
//! asked-for page first (guests touch neighbours). It keeps every page
//! until the destination says it holds them all.
//!
//! From the moment POSTCOPY is written the VM never runs here again
//! (docs/security.md): neither end alone holds it whole.

mod link;
mod resume;

use std::io::{BufReader, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tsubame_codec::batch::BatchCodec;
use tsubame_vmm::DirtyBitmap;

use self::link::{Counters, Heard, Outstanding, Packing, PageFrames, PostcopyLink};
use self::resume::reconnect;
use super::error::SourceError;
use super::fetch::remove_unpopulated;
use super::link::Link;
use super::migration::{ms, Migration};
use super::send::{write_frame_flushed, Writer, DRAINED, DRAIN_LIMIT};
use super::warm;
use crate::digest::HASHES_HANDED;
use crate::protocol::{self, Digest, ErrorMessage, FrameKind, PostcopyDone, PostcopyStart, SourceState};
use crate::stats::{DowntimeBreakdown, PostcopyStats};
use crate::transport::Stream;

/// Pages one background push takes at a time: small, so an asked-for page
/// never waits long for the pusher to look at the requests.
const PUSH_PAGES: usize = 64;

/// The push's codec shrinks its frames at least this many times: then an
/// asked-for page it took goes again all the same, and the push keeps
/// within [`LEAD_PAGES`] of the installs.
const SHRINKS: u64 = 4;

/// How much of the link's time the push may keep queued in it: an
/// asked-for page (on its own connection through the same link) waits
/// behind at most this, plus the link's own round trip.
const PUSH_QUEUE: Duration = Duration::from_micros(500);
/// The push writes at most this much at a time, each piece only once its
/// channel has room (a whole batch of raw pages is 2 ms at 1 Gbit/s).
const PUSH_PIECE: usize = 32 << 10;
/// While the guest waits on asked-for pages (some went out on request in
/// the last CONTENDED_FOR) the push keeps less of the link queued, in
/// smaller pieces: each asked-for page waits behind all of it. (A sparse
/// guest at 1 Gbit/s: fault p99 0.6-4 ms → 0.13-0.15, its first 1024
/// writes at the destination 262-397 ms → 114-129.) A guest that follows
/// the push asks for few pages and keeps the longer queue.
const CONTENDED_QUEUE: Duration = Duration::from_micros(100);
const CONTENDED_WINDOW: usize = 16 << 10;
const CONTENDED_PIECE: usize = 8 << 10;
const CONTENDED_FOR: Duration = Duration::from_millis(20);
/// The shortest the push sleeps waiting for room in its channel.
const MIN_NAP: Duration = Duration::from_micros(50);
/// Pages a push that shrinks pages [`SHRINKS`] times or more may be ahead
/// of what the destination said it took in: a page the guest waits for
/// queues behind at most about these (2 MiB, ~2 ms of installs on this
/// host). The byte window alone let a push that lz4 shrank ~250 times
/// hold 20-30 ms of installs in the link. (A raw push, whose window holds
/// few pages, waiting on the reports too took 13 % longer at 10 Gbit/s.)
const LEAD_PAGES: u64 = 512;
/// A destination silent this long while the push waits on it has lost
/// pages with a cut link (or is stalled): the push goes on, its lead
/// counted from here.
const LEAD_STALE: Duration = Duration::from_millis(20);
/// A channel's unacknowledged bytes never limited below this (TCP needs
/// some in flight to keep even a short link busy).
const MIN_WINDOW: usize = 64 << 10;

/// Rounds of POSTCOPY_PREPARE at most, and the new stale pages a round
/// may find and still leave them to the pause (each costs the destination
/// ~1.4 µs to drop while the VM is stopped).
const PREPARE_ROUNDS: usize = 5;
const FEW_STALE: u64 = 64;

/// How far ahead of its rate the push may burst: an asked-for page queues
/// behind at most this much of it on a shaped link (10 ms bursts put the
/// median fault service at ~1 ms at 1 Gbit/s).
const PUSH_BURST: Duration = Duration::from_millis(1);
/// How often a source waiting for its digest says it is alive (well within the destination's I/O timeout).
const KEEPALIVE: Duration = Duration::from_secs(1);

/// The post-copy phase: what pre-copy hands over.
pub(super) struct Postcopy {
    /// The pages the destination lacks (stale or never sent).
    missing: DirtyBitmap,
    /// The last ITERATION_END sent on every channel (None: pre-copy sent
    /// none).
    last_iteration: Option<u32>,
    /// The link's capacity pre-copy measured (capped; 0: unknown), bytes
    /// per second: the link's rate for the push and its compression where
    /// no cap sets it.
    link_capacity: f64,
}

impl Postcopy {
    /// Post-copy of the pages in `missing`, after the pre-copy iteration
    /// `last_iteration`, over a link pre-copy measured at `link_capacity`.
    pub(super) fn new(missing: DirtyBitmap, last_iteration: Option<u32>, link_capacity: f64) -> Postcopy {
        Postcopy { missing, last_iteration, link_capacity }
    }

    /// Pauses the VM, hands it to the destination with the set of pages it
    /// must not use (`missing`: stale or never sent, to which the pages
    /// dirtied since are added), and sends those pages until it holds
    /// them all.
    pub(super) fn run(self, m: &mut Migration, link: &mut Link) -> Result<(), SourceError> {
        let Postcopy { missing, last_iteration, link_capacity } = self;
        let (vm, options) = (m.vm, m.options);
        // The pages already queued go out while the guest still runs: what
        // it dirties meanwhile is in the dirty log read after the pause.
        // (Draining after the pause cost 80-230 ms of downtime at 1 Gbit/s.)
        let mut writers = link.finish_engine(&mut m.stats, options);
        // And through the link: POSTCOPY must not queue behind them, the
        // destination reads it while the guest is paused.
        super::send::drain(&writers.iter().collect::<Vec<_>>(), DRAINED, DRAIN_LIMIT);
        let timeout_ms = options.postcopy_timeout.as_millis().min(u32::MAX as u128) as u32;
        // Until the destination runs the VM this thread (and the link's,
        // started meanwhile) waits for no running guest to yield a CPU.
        let realtime = tsubame_vmm::cpu_time::realtime_thread();
        // What went stale is dropped at the destination while the guest
        // still runs here; the pause adds only what it dirtied since.
        let handed_over = missing.clone();
        let reader = link.reader.as_mut().expect("connected");
        let (mut missing, mut last) = prepare(m, &mut writers[0], reader, missing, last_iteration, timeout_ms)?;
        m.enter(SourceState::StopAndCopy);
        // Only what the destination needs before it runs the VM happens
        // between the pause and the hand-over; the rest waits until after.
        let mut fresh = vm.dirty_bitmap();
        let paused = Instant::now();
        m.pause_vm()?;
        let stopped = Instant::now();
        // Pages dirtied since are populated, and not far: taken as they are.
        vm.dirty_log(&mut fresh)?;
        last.union_with(&fresh);
        last.subtract(&missing);
        let start = PostcopyStart { last_iteration: None, timeout_ms, missing: last };
        let looked = Instant::now();
        {
            // The set goes first, while the vCPU thread still reads the
            // state: the destination takes it in meanwhile.
            let w = &mut writers[0];
            for payload in &warm::disk_written_frames(m) {
                protocol::write_frame(w, FrameKind::DiskWritten, payload)?;
            }
            write_frame_flushed(w, FrameKind::Postcopy, &start.encode())?;
            let blob = vm.state_blob()?;
            write_frame_flushed(w, FrameKind::State, &blob)?;
        }
        let handed = Instant::now();
        // The point of no return: the destination may run the VM now.
        m.enter(SourceState::Postcopy);
        missing.union_with(&start.missing);
        if let Some(far) = m.far_filter() {
            missing.iter().for_each(|page| far.mark_sent(page));
        }
        let pages = missing.count();
        let started_ms = ms(m.start.elapsed());
        m.stats.postcopy =
            Some(PostcopyStats { started_at_ms: started_ms, pages_missing: pages, ..Default::default() });
        m.stats.stop_reason = crate::stats::StopReason::Postcopy;

        // Every page that may differ from its last hash: those to send
        // are hashed by the senders as they read them (this memory no
        // longer changes), not read again by the digest. (Without pre-copy
        // the digest read every page itself once the destination ran, at
        // normal priority beside the push: a bwmem guest's faults waited
        // 20-50 ms on it.)
        let feed = {
            let digest = m.digest();
            digest.await_hashes(missing.clone());
            // Pages awaited since the hand-over that go nowhere (never
            // populated here, or far) are hashed from memory now,
            // beside the push: at the end, after the last page, 280
            // thousand of a 4 GiB fill-random guest's took 12.6 ms.
            let mut not_sent = handed_over;
            not_sent.subtract(&missing);
            digest.mark(not_sent);
            Some(digest.feed())
        };
        // Asked-for pages and the push are compressed while that pays at
        // the link's rate (pages a guest wrote a few words of shrink a
        // lot, random bytes not at all).
        let bandwidth = link.rate.known_or(link_capacity);
        let codec = options.codecs.batch.unwrap_or(BatchCodec::Lz4);
        let packing = Packing { codec, bandwidth: if bandwidth.is_finite() { bandwidth } else { f64::INFINITY } };
        let counters = Counters::default();
        let outstanding = Arc::new(Mutex::new(Outstanding { unsent: missing, cursor: 0, link: 0 }));
        let reader = link.reader.take().expect("connected");
        let urgent = link.urgent.take();
        let connections = (writers, reader, urgent);
        let pacer = Some(link.pacer.clone());
        let mut postcopy_link = PostcopyLink::start(vm, connections, &outstanding, &counters, pacer, feed, packing);

        // The destination runs the VM once it says so: the downtime ends.
        // (A cut link here is taken back like any other: a destination
        // takes a RESUME only once it runs the VM.)
        let mut resumes = 0;
        match postcopy_link.heard.recv_timeout(options.io_timeout) {
            Ok(Heard::Running(running, heard_at)) => {
                m.stats.cpu_seconds.destination = running.cpu_micros as f64 / 1e6;
                // When the reader heard it, not when this thread woke up.
                m.stats.downtime_ms = ms(heard_at - paused);
                m.stats.downtime_breakdown = DowntimeBreakdown {
                    pause_ms: ms(stopped - paused),
                    final_pages_ms: ms(looked - stopped),
                    state_ms: ms(handed - looked),
                    commit_ms: ms(heard_at.saturating_duration_since(handed)),
                    ..Default::default()
                };
            }
            Ok(Heard::Lost(why)) => {
                m.enter(SourceState::PostcopyPaused);
                let digest = postcopy_link.digest.clone();
                postcopy_link = reconnect(m, link, &why, &outstanding, &counters, digest, packing)
                    .map_err(SourceError::unconfirmed)?;
                resumes += 1;
                m.enter(SourceState::Postcopy);
                m.stats.downtime_ms = ms(paused.elapsed());
            }
            Ok(other) => return Err(postcopy_failure(other)),
            Err(_) => return Err(SourceError::SwitchUnconfirmed("no word within the I/O timeout".into())),
        }
        // The destination runs the VM: this copy is stale from now on.
        m.stats.postcopy.as_mut().expect("set at the switch").switch_confirmed = true;
        drop(realtime);
        m.digest().run_in_background();

        // Push the rest at the link's rate, paced only by the user's cap
        // (asked-for pages count against it too), with a short queue: each
        // channel keeps at most the link's round trip plus PUSH_QUEUE of
        // bytes unacknowledged. (A pace a little under the rate pre-copy
        // measured left 3 % of the link idle, more where the first
        // iteration had measured low, and did not bound the queue where
        // the measure was high. Paced at 0.955 of the cap, for the headers
        // a shaped link counts, it took 0.4 % longer than at the cap: the
        // window keeps the queue short either way.)
        link.pacer.set_rate(link.rate.pacer_rate());
        link.pacer.set_burst(PUSH_BURST);
        let window = PushWindow { bandwidth: (bandwidth > 1.0 && bandwidth.is_finite()).then_some(bandwidth) };
        // The push is bulk work: the threads that serve faults go first.
        let _background = tsubame_vmm::cpu_time::lower_thread_priority();
        let mut frames = PageFrames::packed(packing);
        let done = loop {
            match push_until_done(m, &mut postcopy_link, &outstanding, &mut frames, &counters, &window) {
                Ok(done) => break done,
                Err(Heard::Lost(why)) => {
                    // Both ends keep what they have and wait for the link.
                    m.enter(SourceState::PostcopyPaused);
                    let digest = postcopy_link.digest.clone();
                    postcopy_link = reconnect(m, link, &why, &outstanding, &counters, digest, packing)?;
                    resumes += 1;
                    m.enter(SourceState::Postcopy);
                }
                Err(other) => return Err(postcopy_failure(other)),
            }
        };
        drop(postcopy_link);
        let stats = m.stats.postcopy.as_mut().expect("set at the switch");
        stats.duration_ms = ms(m.start.elapsed()) - started_ms;
        stats.pages_pushed = counters.pushed.load(Ordering::Relaxed);
        stats.pages_sent_on_request = counters.urgent_pages.load(Ordering::Relaxed);
        stats.pages_sent_again = counters.urgent_again.load(Ordering::Relaxed);
        stats.pages_zero = frames.zero;
        if let Some(packer) = frames.packer.as_ref().filter(|p| p.bytes_in > 0) {
            let codec = m.stats.codec.entry(format!("{} (post-copy)", packer.name())).or_default();
            codec.bytes_in += packer.bytes_in;
            codec.bytes_out += packer.bytes_out;
        }
        stats.pages_requested = done.requested;
        stats.faults = done.faults;
        stats.fault_latency_p50_us = done.latency_p50_us;
        stats.fault_latency_p99_us = done.latency_p99_us;
        stats.fault_latency_max_us = done.latency_max_us;
        stats.guest_ops_per_sec = done.guest_ops_per_sec;
        stats.resumes = resumes;
        m.stats.cpu_seconds.destination += done.cpu_micros as f64 / 1e6;
        m.stats.pages_sent += stats.pages_pushed + stats.pages_sent_on_request;
        m.stats.bytes_on_wire = link.pacer.bytes() + counters.urgent_bytes.load(Ordering::Relaxed);
        if done.mismatched > 0 {
            return Err(SourceError::PostcopyCorrupt(done.mismatched));
        }
        m.stats.digest_verified = true;
        Ok(())
    }
}

/// Tells the destination, while the guest still runs, which pages it
/// must drop: `missing` (stale or never sent) and what the dirty log
/// adds, then in rounds what went stale during the last round, until
/// a round finds few new pages. Returns the pages named and those the
/// last look found (left for the pause). `last_iteration`: the last
/// ITERATION_END sent. It writes on channel 0's `writer` and reads its
/// `reader`.
fn prepare(
    m: &mut Migration,
    writer: &mut Writer,
    reader: &mut BufReader<Stream>,
    mut missing: DirtyBitmap,
    last_iteration: Option<u32>,
    timeout_ms: u32,
) -> Result<(DirtyBitmap, DirtyBitmap), SourceError> {
    let vm = m.vm;
    m.enter(SourceState::PostcopyPrepare);
    let mut fresh = vm.dirty_bitmap();
    vm.dirty_log(&mut fresh)?;
    missing.union_with(&fresh);
    // Only this first set needs sifting: later ones hold pages dirtied
    // since, which are populated and not far.
    skip_unneeded(m, &mut missing)?;
    let mut round = PostcopyStart { last_iteration, timeout_ms, missing };
    let mut named = vm.dirty_bitmap();
    let mut previous = u64::MAX;
    for _ in 0..PREPARE_ROUNDS {
        write_frame_flushed(writer, FrameKind::PostcopyPrepare, &round.encode())?;
        named.union_with(&round.missing);
        await_prepared(m, reader)?;
        vm.dirty_log(&mut fresh)?;
        fresh.subtract(&named);
        let new = fresh.count();
        if new <= FEW_STALE || new >= previous {
            break;
        }
        previous = new;
        round = PostcopyStart { last_iteration: None, timeout_ms, missing: fresh.clone() };
        fresh.clear();
    }
    Ok((named, fresh))
}

/// Waits for POSTCOPY_PREPARED on channel 0.
fn await_prepared(m: &Migration, reader: &mut BufReader<Stream>) -> Result<(), SourceError> {
    let mut frame = Vec::new();
    let kind = protocol::read_frame(reader, &mut frame)?;
    m.state.check(kind)?;
    if kind == FrameKind::Error {
        return Err(SourceError::Refused(ErrorMessage::decode(&frame).0));
    }
    Ok(())
}

/// Takes out of `pages` those the destination does not get from here:
/// far memory's ([`super::fetch::FarFilter::remove_unneeded`]), and
/// pages never populated here, whose zeros the destination's fresh
/// memory holds already (pre-copy never sent it other bytes for them):
/// such a page needs no push, and a guest touching it there gets a
/// zero page at once instead of a round trip (a 4 GiB fill-random VM
/// has 1 GiB of them). The pages taken out have their dirty bits
/// cleared, so that a later look at the log shows only pages written
/// since, and are then looked at again: one written meanwhile stays.
fn skip_unneeded(m: &Migration, pages: &mut DirtyBitmap) -> Result<(), SourceError> {
    let mut skipped = pages.clone();
    remove_unneeded(m, pages)?;
    skipped.subtract(pages);
    if skipped.is_empty() {
        return Ok(());
    }
    for (first, words) in skipped.chunks(1024).filter(|(_, words)| words.iter().any(|&w| w != 0)) {
        m.vm.clear_dirty_log(first, words)?;
    }
    // What is left of them once the unneeded go again: written meanwhile.
    remove_unneeded(m, &mut skipped)?;
    pages.union_with(&skipped);
    Ok(())
}

/// [`skip_unneeded`]'s test, without the dirty log.
fn remove_unneeded(m: &Migration, pages: &mut DirtyBitmap) -> Result<(), SourceError> {
    match m.far_filter() {
        Some(far) => far.remove_unneeded(m.vm.memory(), pages)?,
        None => remove_unpopulated(m.vm.memory(), pages),
    }
    Ok(())
}

/// Pushes every page not sent yet, then the digest, and waits for the
/// destination to hold them all. A cut link or a refusal comes back as
/// what was heard.
fn push_until_done(
    m: &Migration,
    link: &mut PostcopyLink,
    outstanding: &Mutex<Outstanding>,
    frames: &mut PageFrames,
    counters: &Counters,
    window: &PushWindow,
) -> Result<PostcopyDone, Heard> {
    let vm = m.vm;
    let lost = |e: std::io::Error| Heard::Lost(format!("link lost while pushing pages: {e}"));
    frames.hash = link.digest.is_some();
    let mut next = 0usize;
    let mut contention = Contention::over(&link.writers);
    let mut lead = Lead::default();
    loop {
        match link.heard.try_recv() {
            // A destination that had every page before a cut says so
            // again as the link comes back.
            Ok(Heard::Done(done)) => return Ok(done),
            Ok(event) => return Err(event),
            Err(_) => {}
        }
        // Whether the push shrinks pages, by what its codec made of the
        // frames it compressed so far (zero pages, a few bytes each
        // anyway, do not count).
        if let Some(packer) = frames.packer.as_ref().filter(|p| p.bytes_in > 0) {
            let shrinks = packer.bytes_out * SHRINKS <= packer.bytes_in;
            counters.push_shrinks.store(shrinks, Ordering::Relaxed);
        }
        // Pages the link holds raw are few: its byte window bounds them.
        if counters.push_shrinks.load(Ordering::Relaxed) {
            lead.wait(counters.pushed.load(Ordering::Relaxed), &counters.installed);
        }
        let batch = outstanding.lock().unwrap().take(PUSH_PAGES);
        if batch.is_empty() {
            break;
        }
        counters.pushed.fetch_add(batch.len() as u64, Ordering::Relaxed);
        let bytes = frames.frames(vm.memory(), &batch).map_err(|e| Heard::Refused(e.to_string()))?;
        let channels = link.writers.len();
        // Straight on to the socket: an asked-for page the push took
        // is not sent again, so it must not wait in a buffer. (Past
        // the writer's buffer, once it is empty: a copy less.)
        let writer = &mut link.writers[next % channels];
        writer.flush().map_err(lost)?;
        let mut rest = bytes;
        while !rest.is_empty() {
            let contended = contention.now(&counters.urgent_pages);
            let piece = if contended { CONTENDED_PIECE } else { PUSH_PIECE };
            let (now, later) = rest.split_at(piece.min(rest.len()));
            window.wait_for_room(writer, contended);
            writer.get_mut().write_all(now).map_err(lost)?;
            rest = later;
        }
        next += 1;
        if let Some(digest) = &link.digest {
            frames.hand_hashes(digest, HASHES_HANDED);
        }
    }
    if let Some(digest) = &link.digest {
        frames.hand_hashes(digest, 1);
    }
    for w in &mut link.writers {
        w.flush().map_err(lost)?;
    }
    // The destination takes a link silent for its I/O timeout as cut.
    // Hashing what changed since the switch can take that long on a
    // busy host (a 4 GiB guest lost this way beside the fault suite):
    // meanwhile a POSTCOPY_PAGES frame with no records says the source
    // is still here.
    let pending = m.digest.as_ref().expect("pre-copy marked memory").request_hashes();
    let hashes = loop {
        match pending.recv_timeout(KEEPALIVE) {
            Ok(hashes) => break hashes,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                let alive = frames.keepalive();
                link.writers[0].write_all(alive).and_then(|_| link.writers[0].flush()).map_err(lost)?;
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                return Err(Heard::Refused("the digest thread ended".into()))
            }
        }
    };
    let digest = Digest { region: m.options.digest_region, hashes };
    write_frame_flushed(&mut link.writers[0], FrameKind::Digest, &digest.encode()).map_err(lost)?;
    loop {
        match link.heard.recv_timeout(Duration::from_secs(1)) {
            Ok(Heard::Done(done)) => return Ok(done),
            Ok(other) => return Err(other),
            Err(_) if link.reader.is_finished() => return Err(Heard::Lost("the destination went silent".into())),
            Err(_) => continue,
        }
    }
}

/// The error for what the destination said or did instead of finishing.
fn postcopy_failure(heard: Heard) -> SourceError {
    match heard {
        Heard::Refused(reason) => SourceError::PostcopyLost(format!("destination refused: {reason}")),
        Heard::Lost(why) => SourceError::PostcopyLost(why),
        Heard::Running(..) | Heard::Done(_) => SourceError::PostcopyLost("the destination spoke out of turn".into()),
    }
}

/// The push's lead over the destination's installs, in pages.
#[derive(Default)]
struct Lead {
    /// Pages pushed that the destination will never count: lost in a cut
    /// link (only ever as large as pushed less installed).
    lost: u64,
}

impl Lead {
    /// Waits until at most [`LEAD_PAGES`] of the `pushed` pages are not
    /// yet taken in, as far as `installed` says, or until it stopped
    /// changing for [`LEAD_STALE`].
    fn wait(&mut self, pushed: u64, installed: &AtomicU64) {
        let mut seen = installed.load(Ordering::Relaxed);
        let mut since = Instant::now();
        loop {
            let out = pushed.saturating_sub(seen);
            self.lost = self.lost.min(out);
            if out - self.lost <= LEAD_PAGES {
                return;
            }
            std::thread::sleep(MIN_NAP);
            let now = installed.load(Ordering::Relaxed);
            if now != seen {
                (seen, since) = (now, Instant::now());
            } else if since.elapsed() >= LEAD_STALE {
                self.lost = pushed.saturating_sub(seen);
                return;
            }
        }
    }
}

/// Whether the guest waits on pages the push has not reached: some went
/// out on request in the last [`CONTENDED_FOR`].
struct Contention {
    /// Whether asked-for pages queue behind the push at all: over TCP, in
    /// the network's queues. A Unix socket has none they share, and there
    /// the short queue only slowed the push (a sparse demo's phase by a
    /// third).
    shared_queue: bool,
    /// Pages sent on request, as last seen.
    seen: u64,
    until: Option<Instant>,
}

impl Contention {
    /// For the push over `writers` (one transport for all).
    fn over(writers: &[Writer]) -> Contention {
        let shared_queue = writers.first().is_some_and(|w| super::send::tcp_fd(w).is_some());
        Contention { shared_queue, seen: 0, until: None }
    }

    fn now(&mut self, sent_on_request: &AtomicU64) -> bool {
        if !self.shared_queue {
            return false;
        }
        let sent = sent_on_request.load(Ordering::Relaxed);
        let now = Instant::now();
        if sent != self.seen {
            self.seen = sent;
            self.until = Some(now + CONTENDED_FOR);
        }
        self.until.is_some_and(|until| now < until)
    }
}

/// The push's queue in the link: a channel takes more only while few of
/// its bytes wait unacknowledged.
struct PushWindow {
    /// The link's rate in bytes per second, when known.
    bandwidth: Option<f64>,
}

impl PushWindow {
    /// Waits until `writer`'s socket holds at most the window (or 100 ms
    /// passed: a stalled link shows as an error of the write instead).
    fn wait_for_room(&self, writer: &Writer, contended: bool) {
        let (Some(window), Some(bandwidth)) = (self.window(writer, contended), self.bandwidth) else { return };
        let deadline = Instant::now() + Duration::from_millis(100);
        while let Some(over) = super::send::unsent_bytes(writer).and_then(|n| n.checked_sub(window)) {
            let now = Instant::now();
            if over == 0 || now >= deadline {
                break;
            }
            // About as long as the link takes to carry the excess: one
            // wake-up per piece (a 100 µs step woke ~3 times per piece at
            // 1 Gbit/s, with a look at the socket each time). Not clamp:
            // under MIN_NAP before the deadline it panicked (min > max).
            let drain = Duration::from_secs_f64(over as f64 / bandwidth);
            std::thread::sleep(drain.max(MIN_NAP).min(deadline - now));
        }
    }

    /// The link's rate times its round trip plus PUSH_QUEUE (or, while
    /// `contended`, CONTENDED_QUEUE); None (no limit) for a link of unknown
    /// rate or a stream that cannot tell.
    fn window(&self, writer: &Writer, contended: bool) -> Option<usize> {
        let bandwidth = self.bandwidth?;
        let rtt = super::send::min_rtt(writer).unwrap_or_default();
        let (queue, least) = if contended { (CONTENDED_QUEUE, CONTENDED_WINDOW) } else { (PUSH_QUEUE, MIN_WINDOW) };
        Some(((bandwidth * (rtt + queue).as_secs_f64()) as usize).max(least))
    }
}

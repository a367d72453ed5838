//! Stop-and-copy: pause the guest, send the last dirty pages, the vCPU and
//! device state and the memory digest, re-send regions the destination
//! finds different, and commit once it is ready.

use std::io::BufReader;
use std::time::Instant;

use tsubame_vmm::{memory, DirtyBitmap, PAGE_SIZE};

use super::error::SourceError;
use super::fetch::Batch;
use super::iteration::{send_dirty, Pass};
use super::link::Link;
use super::migration::{ms, Migration};
use super::warm;
use crate::protocol::{
    self, Digest, DigestUpdate, ErrorMessage, FrameKind, Mismatch, Resumed, SourceState, MAX_REPAIR_ROUNDS,
};
use crate::stats::DowntimeBreakdown;
use crate::transport::Stream;

/// How long the commit's answer is looked for without sleeping: it comes
/// within a fraction of a millisecond, and a thread that slept for it was
/// woken 0.08-0.1 ms late on the CPU where the destination's vCPU, just
/// released, ran the guest (both ends on one host here).
const COMMIT_SPIN: std::time::Duration = std::time::Duration::from_millis(1);

/// The most dirty pages of a stop whose stages run in turn on the
/// migration thread ([`super::engine::Engine::run_in_turn`]): a few
/// pages' hand-offs to other threads cost more than the work on them
/// (gmigrate-best's stops of 2-23 pages), while 489 whole pages at 1
/// Gbit/s took 1.99 ms in turn against 0.84 in threads (demo, kv).
const IN_TURN_STOP_PAGES: u64 = 64;

/// The stop-and-copy phase.
pub(super) struct Stop {
    /// Dirty pages still to send when iterating stopped.
    pending: DirtyBitmap,
    /// The digest sent before the pause: the stop sends what changed.
    digest_sent: Option<Vec<u64>>,
    /// The guest's throttle (auto-converge), for the stop's figures.
    throttle: f64,
    /// Every CPU, while the stop keeps the digest's thread apart.
    apart: Option<Vec<usize>>,
}

impl Stop {
    /// The stop of a pre-copy that left `pending` dirty (without manual
    /// protect, cleared in KVM: the stop adds what comes after) and sent
    /// `digest_sent` before the pause.
    pub(super) fn new(pending: DirtyBitmap, digest_sent: Option<Vec<u64>>, throttle: f64) -> Stop {
        Stop { pending, digest_sent, throttle, apart: None }
    }

    /// Pauses the guest, sends the last dirty pages, state and digest, and
    /// commits once the destination is ready.
    pub(super) fn run(mut self, m: &mut Migration, link: &mut Link) -> Result<(), SourceError> {
        // The reader goes back whatever happens: after a failure it may
        // still hold the destination's ERROR frame.
        let mut reader = link.reader.take().expect("connected");
        let result = self.run_reading(m, link, &mut reader);
        link.reader = Some(reader);
        if let Some(all) = self.apart.take() {
            tsubame_vmm::cpu_time::set_thread_cpus(tsubame_vmm::cpu_time::this_pthread(), &all);
            m.digest().run_on(&all);
        }
        result
    }

    fn run_reading(
        &mut self,
        m: &mut Migration,
        link: &mut Link,
        reader: &mut BufReader<Stream>,
    ) -> Result<(), SourceError> {
        let vm = m.vm;
        let mut frame = Vec::new();
        let pending = &mut self.pending;
        // A stop of a few pages runs its stages in turn here, without a
        // hand-off to another thread.
        if pending.count() <= IN_TURN_STOP_PAGES {
            link.engine().run_in_turn(pending.count() as usize)?;
            self.apart = keep_digest_apart(m);
        }
        m.enter(SourceState::StopAndCopy);
        let paused = Instant::now();
        let mut lap = paused;
        let mut laps = |slot: &mut f64| {
            let now = Instant::now();
            *slot = ms(now - lap);
            lap = now;
        };
        let mut breakdown = DowntimeBreakdown::default();
        let quick = tsubame_vmm::cpu_time::quick_wakeups();
        // Under SCHED_FIFO only once the last page is read (`Sent::realtime`):
        // before, this thread reads and hashes every page, and ahead of
        // the destination's threads the whole stop took longer (the
        // commit's round trip up to 3.9 ms instead of 0.2-0.3).
        m.pause_vm()?;
        laps(&mut breakdown.pause_ms);
        // Before STATE: the destination drops its stale early copies of
        // the blocks written since the last iteration's list.
        warm::send_disk_written(m, link)?;
        // With manual protect KVM's bits stay set until cleared, so the new
        // log is a superset of them; the VMM's own writes were taken with
        // the last log and are only in `pending`: keep both.
        vm.add_dirty_log(pending)?;
        let iteration = m.stats.iterations;
        // The fetch hashes what it reads (the guest is paused): the digest
        // then reads none of the last pages again (a bwmem guest's 3000
        // took 1.2-2 ms to hash after they went out), and answers before
        // the pipeline has drained.
        let mut sent = send_dirty(m, link, pending, iteration, Pass::Paused { throttle: self.throttle })?;
        let realtime = sent.realtime.take();
        m.stats.per_iteration.push(sent.it);
        laps(&mut breakdown.final_pages_ms);

        // Every channel ended the iteration: channel 0 carries the rest.
        let blob = vm.state_blob()?;
        link.write_control(FrameKind::State, &blob)?;
        laps(&mut breakdown.state_ms);
        let hashes = sent.digest.expect("a paused send asks for the digest").recv().expect("digest thread answers");
        let region_count = hashes.len();
        let region = m.options.digest_region;
        let whole = || Digest { region, hashes: hashes.clone() }.encode();
        // Freed after the stop, as the destination frees the digests it
        // compared (unmapping them took ~0.04 ms of a 4 GiB guest's stop).
        let sent_before = self.digest_sent.take();
        match &sent_before {
            Some(before) => {
                let update = DigestUpdate::between(region, before, &hashes);
                link.write_control(FrameKind::DigestUpdate, &update.encode())?;
            }
            None => link.write_control(FrameKind::Digest, &whole())?,
        }
        m.stats.bytes_on_wire = link.engine().bytes();
        laps(&mut breakdown.source_digest_ms);

        // From the last page read to RESUMED this thread waits (for the
        // pipeline, the digest, the destination) or writes a frame
        // (re-sent regions aside, which are rare): it runs without waiting
        // for a CPU. (Woken by READY or preempted while writing COMMIT, it
        // waited 0.4-1 ms behind the destination's threads; woken by the
        // pipeline's end, 0.6-0.9 ms in 3 of 5 kv stops. The destination
        // does the same from READY on.)
        let mut rounds = 0;
        loop {
            let kind = protocol::read_frame(reader, &mut frame)?;
            m.state.check(kind)?;
            match kind {
                FrameKind::Ready => break,
                FrameKind::Mismatch if rounds < MAX_REPAIR_ROUNDS => {
                    rounds += 1;
                    let mismatch = Mismatch::decode(&frame, region_count)?;
                    resend_regions(m, link, &mismatch.regions, iteration + rounds)?;
                    link.write_control(FrameKind::Digest, &whole())?;
                }
                FrameKind::Error => return Err(SourceError::Refused(ErrorMessage::decode(&frame).0)),
                other => return Err(protocol::WireError::Unexpected { got: other, expected: "READY" }.into()),
            }
        }
        m.stats.digest_verified = true;
        laps(&mut breakdown.destination_verify_ms);

        // The point of no return: once COMMIT is out, only the destination
        // may run the VM. A failed write means it cannot have arrived whole.
        link.write_control(FrameKind::Commit, &[])?;
        m.enter(SourceState::Committing);
        if reader.buffer().is_empty() {
            reader.get_ref().spin_until_readable(COMMIT_SPIN);
        }
        let confirmed =
            protocol::read_frame(reader, &mut frame).map_err(|e| SourceError::CommitUnconfirmed(e.to_string()))?;
        if confirmed != FrameKind::Resumed {
            return Err(SourceError::CommitUnconfirmed(format!("got {confirmed:?} instead of RESUMED")));
        }
        laps(&mut breakdown.commit_ms);
        m.stats.downtime_ms = ms(paused.elapsed());
        // Back under the normal scheduler only now: it may give the CPU
        // away at once (0.9 ms once), after the VM already ran there.
        drop((realtime, quick));
        m.stats.downtime_breakdown = breakdown;
        if let Ok(resumed) = Resumed::decode(&frame) {
            m.stats.cpu_seconds.destination = resumed.cpu_micros as f64 / 1e6;
        }
        m.stats.bytes_on_wire = link.engine().bytes();
        Ok(())
    }
}

/// Sends every page of the given digest regions whole, through the
/// pages' own shards so the codec caches see them in order: the repair
/// pass after the destination reported a mismatch.
fn resend_regions(m: &mut Migration, link: &mut Link, regions: &[u32], iteration: u32) -> Result<(), SourceError> {
    let vm = m.vm;
    let pages_per_region = (m.options.digest_region as usize / PAGE_SIZE) as u64;
    let layout = link.engine().layout();
    let mut batch: Option<Batch> = None;
    let mut batch_first = u64::MAX;
    for &region in regions {
        let first = region as u64 * pages_per_region;
        for index in first..(first + pages_per_region).min(m.stats.pages_total) {
            let chunk_first = index - index % layout.batch_pages;
            if batch.is_some() && chunk_first != batch_first {
                link.engine().submit(batch.take().unwrap())?;
            }
            if batch.is_none() {
                let mut fresh = link.engine().take_batch()?;
                fresh.clear(iteration, layout.shard(chunk_first), true);
                batch = Some(fresh);
                batch_first = chunk_first;
            }
            let b = batch.as_mut().unwrap();
            memory::read_page(vm.memory(), index, b.next_slot()).map_err(tsubame_vmm::VmError::from)?;
            b.push(index, true);
            if let Some(far) = m.far_filter() {
                far.mark_sent(index);
            }
        }
    }
    if let Some(b) = batch {
        link.engine().submit(b)?;
    }
    m.stats.pages_sent += link.engine().end_iteration(iteration)?;
    m.stats.regions_repaired += regions.len() as u64;
    Ok(())
}

/// Keeps this thread on its CPU and the digest's thread off it until
/// the stop ends: a stop whose stages run in turn here wakes the
/// digest as it reads the last page, and this host's scheduler (which
/// packs threads onto busy CPUs) queued it behind this thread while
/// the other CPU idled: its answer came 0.1-0.28 ms later, not 0.02.
/// Set while the guest still runs; returns every CPU, to go back to.
fn keep_digest_apart(m: &mut Migration) -> Option<Vec<usize>> {
    use tsubame_vmm::cpu_time::{set_thread_cpus, this_pthread, CpuSplit};
    let cpus = CpuSplit::here()?;
    set_thread_cpus(this_pthread(), &[cpus.here]);
    m.digest().run_on(&cpus.others);
    Some(cpus.all)
}

//! Stop-and-copy: pause the guest, send the last dirty pages, the vCPU and
//! device state and the memory digest, re-send regions the destination
//! finds different, and commit once it is ready.

use std::time::Instant;

use tsubame_vmm::{memory, PAGE_SIZE};

use super::send::write_frame_flushed;
use super::{ms, SourceError, SourceRun};
use crate::protocol::{
    self, Digest, DigestUpdate, ErrorMessage, FrameKind, Mismatch, Resumed, SourceState, MAX_REPAIR_ROUNDS,
};
use crate::stats::DowntimeBreakdown;

/// How long the commit's answer is looked for without sleeping: it comes
/// within a fraction of a millisecond, and a thread that slept for it was
/// woken 0.08-0.1 ms late on the CPU where the destination's vCPU, just
/// released, ran the guest (both ends on one host here).
const COMMIT_SPIN: std::time::Duration = std::time::Duration::from_millis(1);

impl SourceRun<'_> {
    /// Pauses the guest, sends the last dirty pages, state and digest, and
    /// commits once the destination is ready.
    pub(super) fn stop_and_copy(&mut self) -> Result<(), SourceError> {
        // The reader goes back whatever happens: after a failure it may
        // still hold the destination's ERROR frame.
        let mut reader = self.reader.take().expect("connected");
        let result = self.stop_and_copy_reading(&mut reader);
        self.reader = Some(reader);
        if let Some(all) = self.apart.take() {
            tsubame_vmm::cpu_time::set_thread_cpus(tsubame_vmm::cpu_time::this_pthread(), &all);
            self.digest().run_on(&all);
        }
        result
    }

    /// Keeps this thread on its CPU and the digest's thread off it until
    /// the stop ends: a stop whose stages run in turn here wakes the
    /// digest as it reads the last page, and this host's scheduler (which
    /// packs threads onto busy CPUs) queued it behind this thread while
    /// the other CPU idled: its answer came 0.1-0.28 ms later, not 0.02.
    /// Set while the guest still runs.
    fn keep_digest_apart(&mut self) {
        use tsubame_vmm::cpu_time::{set_thread_cpus, this_pthread, CpuSplit};
        let Some(cpus) = CpuSplit::here() else { return };
        set_thread_cpus(this_pthread(), &[cpus.here]);
        self.digest().run_on(&cpus.others);
        self.apart = Some(cpus.all);
    }

    fn stop_and_copy_reading(
        &mut self,
        reader: &mut std::io::BufReader<crate::transport::Stream>,
    ) -> Result<(), SourceError> {
        let vm = self.vm;
        let mut frame = Vec::new();
        let mut pending = self.pending.take().expect("precopy leaves the pending dirty set");
        // A stop of a few pages runs its stages in turn here, without a
        // hand-off to another thread.
        if pending.count() <= super::precopy::IN_TURN_STOP_PAGES {
            self.engine().run_in_turn(pending.count() as usize)?;
            self.keep_digest_apart();
        }
        self.enter(SourceState::StopAndCopy);
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
        self.pause_vm()?;
        laps(&mut breakdown.pause_ms);
        // Before STATE: the destination drops its stale early copies of
        // the blocks written since the last iteration's list.
        self.send_disk_written()?;
        // With manual protect KVM's bits stay set until cleared, so the new
        // log is a superset of them; the VMM's own writes were taken with
        // the last log and are only in `pending`: keep both.
        vm.add_dirty_log(&mut pending)?;
        let iteration = self.stats.iterations;
        // The fetch hashes what it reads (the guest is paused): the digest
        // then reads none of the last pages again (a bwmem guest's 3000
        // took 1.2-2 ms to hash after they went out), and answers before
        // the pipeline has drained.
        let mut sent = self.send_dirty(&pending, iteration, None, true)?;
        let realtime = sent.realtime.take();
        self.stats.per_iteration.push(sent.it);
        laps(&mut breakdown.final_pages_ms);

        // Every channel ended the iteration: channel 0 carries the rest.
        let blob = vm.state_blob()?;
        self.write_control(FrameKind::State, &blob)?;
        laps(&mut breakdown.state_ms);
        let hashes = sent.digest.expect("a paused send asks for the digest").recv().expect("digest thread answers");
        let region_count = hashes.len();
        let region = self.options.digest_region;
        let whole = || Digest { region, hashes: hashes.clone() }.encode();
        // Freed after the stop, as the destination frees the digests it
        // compared (unmapping them took ~0.04 ms of a 4 GiB guest's stop).
        let sent_before = self.digest_sent.take();
        match &sent_before {
            Some(before) => {
                let update = DigestUpdate::between(region, before, &hashes);
                self.write_control(FrameKind::DigestUpdate, &update.encode())?;
            }
            None => self.write_control(FrameKind::Digest, &whole())?,
        }
        self.stats.bytes_on_wire = self.engine().bytes();
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
            self.state.check(kind)?;
            match kind {
                FrameKind::Ready => break,
                FrameKind::Mismatch if rounds < MAX_REPAIR_ROUNDS => {
                    rounds += 1;
                    let mismatch = Mismatch::decode(&frame, region_count)?;
                    self.resend_regions(&mismatch.regions, iteration + rounds)?;
                    self.write_control(FrameKind::Digest, &whole())?;
                }
                FrameKind::Error => return Err(SourceError::Refused(ErrorMessage::decode(&frame).0)),
                other => return Err(protocol::WireError::Unexpected { got: other, expected: "READY" }.into()),
            }
        }
        self.stats.digest_verified = true;
        laps(&mut breakdown.destination_verify_ms);

        // The point of no return: once COMMIT is out, only the destination
        // may run the VM. A failed write means it cannot have arrived whole.
        self.write_control(FrameKind::Commit, &[])?;
        self.enter(SourceState::Committing);
        if reader.buffer().is_empty() {
            reader.get_ref().spin_until_readable(COMMIT_SPIN);
        }
        let confirmed =
            protocol::read_frame(reader, &mut frame).map_err(|e| SourceError::CommitUnconfirmed(e.to_string()))?;
        if confirmed != FrameKind::Resumed {
            return Err(SourceError::CommitUnconfirmed(format!("got {confirmed:?} instead of RESUMED")));
        }
        laps(&mut breakdown.commit_ms);
        self.stats.downtime_ms = ms(paused.elapsed());
        // Back under the normal scheduler only now: it may give the CPU
        // away at once (0.9 ms once), after the VM already ran there.
        drop((realtime, quick));
        self.stats.downtime_breakdown = breakdown;
        if let Ok(resumed) = Resumed::decode(&frame) {
            self.stats.cpu_seconds.destination = resumed.cpu_micros as f64 / 1e6;
        }
        self.stats.bytes_on_wire = self.engine().bytes();
        Ok(())
    }

    /// Pauses the VM for the switch, noting when on the host's monotonic
    /// clock (for traces) and on the Unix clock (the vCPU's own stop, which
    /// the harness lines up with the destination's resume).
    pub(super) fn pause_vm(&mut self) -> Result<(), SourceError> {
        self.stats.paused_at_monotonic_s = tsubame_vmm::cpu_time::monotonic_seconds();
        self.vm.pause_for_state()?;
        self.stats.paused_at_unix_us = self.vm.paused_at_unix_us();
        Ok(())
    }

    /// Writes a control frame on channel 0 and flushes it.
    pub(super) fn write_control(&mut self, kind: FrameKind, payload: &[u8]) -> Result<(), SourceError> {
        let mut writer = self.engine().writer(0);
        write_frame_flushed(&mut *writer, kind, payload)?;
        Ok(())
    }

    /// Sends every page of the given digest regions whole, through the
    /// pages' own shards so the codec caches see them in order: the repair
    /// pass after the destination reported a mismatch.
    fn resend_regions(&mut self, regions: &[u32], iteration: u32) -> Result<(), SourceError> {
        let vm = self.vm;
        let pages_per_region = (self.options.digest_region as usize / PAGE_SIZE) as u64;
        let layout = self.engine().layout();
        let mut batch: Option<super::fetch::Batch> = None;
        let mut batch_first = u64::MAX;
        for &region in regions {
            let first = region as u64 * pages_per_region;
            for index in first..(first + pages_per_region).min(self.stats.pages_total) {
                let chunk_first = index - index % layout.batch_pages;
                if batch.is_some() && chunk_first != batch_first {
                    self.engine().submit(batch.take().unwrap())?;
                }
                if batch.is_none() {
                    let mut fresh = self.engine().take_batch()?;
                    fresh.clear(iteration, layout.shard(chunk_first), true);
                    batch = Some(fresh);
                    batch_first = chunk_first;
                }
                let b = batch.as_mut().unwrap();
                memory::read_page(vm.memory(), index, b.next_slot()).map_err(tsubame_vmm::VmError::from)?;
                b.push(index, true);
                if let Some(far) = &self.far_filter {
                    far.mark_sent(index);
                }
            }
        }
        if let Some(b) = batch {
            self.engine().submit(b)?;
        }
        self.stats.pages_sent += self.engine().end_iteration(iteration)?;
        self.stats.regions_repaired += regions.len() as u64;
        Ok(())
    }
}

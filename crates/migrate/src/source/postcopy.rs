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

use std::io::{BufReader, BufWriter, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use tsubame_codec::zero::is_zero;
use tsubame_vmm::{memory, DirtyBitmap, PAGE_SIZE};

use super::send::write_frame_flushed;
use super::vm::SourceVm;
use super::{ms, SourceError, SourceRun};
use crate::protocol::messages::MAX_REQUEST;
use crate::protocol::pages::{Encoding, PagesBuilder, RECORDS_PER_FRAME};
use crate::protocol::{
    self, Digest, ErrorMessage, FrameKind, PageRequest, PostcopyDone, PostcopyRunning, PostcopyStart, SourceState,
    WireError,
};
use crate::stats::PostcopyStats;
use crate::transport::Stream;

/// Pages one background push takes at a time: small, so an asked-for page
/// never waits long for the pusher to look at the requests.
const PUSH_PAGES: usize = 64;

/// The background push runs at this share of the link's measured rate,
/// so the link's queue stays short and asked-for pages pass quickly.
const PUSH_SHARE: f64 = 0.95;

/// What the channel-0 reader hears from the destination.
enum Heard {
    Running(PostcopyRunning),
    Done(PostcopyDone),
    Refused(String),
    Lost(String),
}

/// What the destination still lacks, as this end knows it.
struct Outstanding {
    /// Pages not sent yet since the switch.
    unsent: DirtyBitmap,
    /// Where the background push goes on (the page after the last one
    /// asked for, for locality).
    cursor: u64,
}

impl Outstanding {
    /// Takes up to `n` unsent pages from the cursor on, wrapping once.
    fn take(&mut self, n: usize) -> Vec<u64> {
        let pages = self.unsent.pages();
        let start = self.cursor.min(pages);
        let mut out = Vec::with_capacity(n);
        for (from, to) in [(start, pages), (0, start)] {
            let mut at = from;
            while at < to && out.len() < n {
                let word = self.unsent.words()[(at / 64) as usize] >> (at % 64);
                if word == 0 {
                    at = (at / 64 + 1) * 64;
                    continue;
                }
                at += word.trailing_zeros() as u64;
                if at >= to {
                    break;
                }
                out.push(at);
                self.unsent.unset(at);
                at += 1;
            }
        }
        if let Some(&last) = out.last() {
            self.cursor = last + 1;
        }
        out
    }
}

/// Builds POSTCOPY_PAGES frames of raw and zero records from a paused VM.
struct PageFrames {
    builder: PagesBuilder,
    page: [u8; PAGE_SIZE],
    out: Vec<u8>,
    zero: u64,
}

impl PageFrames {
    fn new() -> PageFrames {
        PageFrames { builder: PagesBuilder::new(RECORDS_PER_FRAME), page: [0; PAGE_SIZE], out: Vec::new(), zero: 0 }
    }

    /// The frames carrying `pages`, read from `vm`'s (paused) memory.
    fn frames(&mut self, vm: &dyn SourceVm, pages: &[u64]) -> Result<&[u8], SourceError> {
        self.out.clear();
        for chunk in pages.chunks(RECORDS_PER_FRAME) {
            self.builder.reset(u32::MAX, 0);
            for &index in chunk {
                memory::read_page(vm.memory(), index, &mut self.page).map_err(tsubame_vmm::VmError::from)?;
                if is_zero(&self.page) {
                    self.builder.push(index, Encoding::Zero, &[]);
                    self.zero += 1;
                } else {
                    self.builder.push(index, Encoding::Raw, &self.page);
                }
            }
            protocol::write_frame(&mut self.out, FrameKind::PostcopyPages, self.builder.payload()).expect("Vec writes");
        }
        Ok(&self.out)
    }
}

impl SourceRun<'_> {
    /// Pauses the VM, hands it to the destination with the set of pages it
    /// must not use (`missing`: stale or never sent, to which the pages
    /// dirtied since are added), and sends those pages until it holds
    /// them all. `last_iteration`: the last ITERATION_END sent.
    pub(super) fn postcopy(
        &mut self,
        mut missing: DirtyBitmap,
        last_iteration: Option<u32>,
    ) -> Result<(), SourceError> {
        let vm = self.vm;
        self.enter(SourceState::StopAndCopy);
        let paused = Instant::now();
        vm.pause()?;
        let mut fresh = vm.dirty_bitmap();
        vm.dirty_log(&mut fresh)?;
        missing.union_with(&fresh);
        // Every page that may differ from its last hash; hashed while the
        // destination already runs (this memory no longer changes).
        self.refresh_digest(&missing);
        if last_iteration.is_none() {
            self.refresh_digest(&DirtyBitmap::full(missing.pages()));
        }
        let mut writers = self.finish_engine();
        let pages = missing.count();
        let start = PostcopyStart { last_iteration, missing: missing.clone() };
        let blob = vm.state_blob()?;
        {
            let w = &mut writers[0];
            protocol::write_frame(w, FrameKind::Postcopy, &start.encode())?;
            write_frame_flushed(w, FrameKind::State, &blob)?;
        }
        // The point of no return: the destination may run the VM now.
        self.enter(SourceState::Postcopy);
        let started_ms = ms(self.start.elapsed());
        self.stats.postcopy =
            Some(PostcopyStats { started_at_ms: started_ms, pages_missing: pages, ..Default::default() });
        self.stats.stop_reason = crate::stats::StopReason::Postcopy;

        let reader = self.reader.take().expect("connected");
        let (heard_tx, heard) = unbounded();
        let (requests_tx, requests) = unbounded::<Vec<u64>>();
        let reader_thread = spawn_reader(reader, vm.memory_bytes() / PAGE_SIZE as u64, heard_tx.clone(), requests_tx);
        let outstanding = Arc::new(Mutex::new(Outstanding { unsent: missing, cursor: 0 }));
        let urgent_sent = Arc::new(AtomicU64::new(0));
        let urgent_bytes = Arc::new(AtomicU64::new(0));
        let urgent = self.urgent.take().map(|stream| {
            let server = UrgentServer {
                writer: BufWriter::with_capacity(256 << 10, stream),
                outstanding: outstanding.clone(),
                sent: urgent_sent.clone(),
                bytes: urgent_bytes.clone(),
            };
            let vm_pages = VmPages::of(vm);
            let heard = heard_tx.clone();
            std::thread::Builder::new()
                .name("postcopy-urgent".into())
                .spawn(move || server.run(vm_pages, requests, heard))
                .expect("spawn post-copy request server")
        });

        // The destination runs the VM once it says so: the downtime ends.
        match heard.recv_timeout(self.options.io_timeout) {
            Ok(Heard::Running(running)) => {
                self.stats.downtime_ms = ms(paused.elapsed());
                self.stats.cpu_seconds.destination = running.cpu_micros as f64 / 1e6;
            }
            Ok(Heard::Refused(reason)) => {
                return Err(SourceError::PostcopyLost(format!("destination refused: {reason}")))
            }
            Ok(Heard::Lost(why)) => return Err(SourceError::PostcopyLost(why)),
            Ok(Heard::Done(_)) | Err(_) => {
                return Err(SourceError::PostcopyLost("the destination did not say it runs the VM".into()))
            }
        }

        // Push the rest, a little under the link's rate.
        let bandwidth = self.policy.bandwidth_for(self.options);
        if bandwidth > 1.0 && bandwidth.is_finite() {
            if let Some(pacer) = &self.pacer {
                pacer.set_rate(Some((bandwidth * PUSH_SHARE) as u64));
            }
        }
        let mut frames = PageFrames::new();
        let mut pushed = 0u64;
        let mut next = 0usize;
        loop {
            if let Ok(event) = heard.try_recv() {
                return Err(self.postcopy_failure(event));
            }
            let batch = outstanding.lock().unwrap().take(PUSH_PAGES);
            if batch.is_empty() {
                break;
            }
            pushed += batch.len() as u64;
            let bytes = frames.frames(vm, &batch)?;
            let channels = writers.len();
            let w = &mut writers[next % channels];
            next += 1;
            if let Err(e) = w.write_all(bytes) {
                return Err(SourceError::PostcopyLost(format!("link lost while pushing pages: {e}")));
            }
        }
        for w in &mut writers {
            w.flush().map_err(|e| SourceError::PostcopyLost(format!("link lost while pushing pages: {e}")))?;
        }
        let hashes = self.digest.as_ref().expect("pre-copy marked memory").hashes();
        let digest = Digest { region: self.options.digest_region, hashes };
        write_frame_flushed(&mut writers[0], FrameKind::Digest, &digest.encode())
            .map_err(|e| SourceError::PostcopyLost(format!("link lost before the digest went out: {e}")))?;

        let done = loop {
            match heard.recv_timeout(Duration::from_secs(1)) {
                Ok(Heard::Done(done)) => break done,
                Ok(other) => return Err(self.postcopy_failure(other)),
                Err(_) if reader_thread.is_finished() => {
                    return Err(SourceError::PostcopyLost("the destination went silent".into()))
                }
                Err(_) => continue,
            }
        };
        drop(writers);
        drop(urgent);
        let stats = self.stats.postcopy.as_mut().expect("set at the switch");
        stats.duration_ms = ms(self.start.elapsed()) - started_ms;
        stats.pages_pushed = pushed;
        stats.pages_sent_on_request = urgent_sent.load(Ordering::Relaxed);
        stats.pages_zero = frames.zero;
        stats.pages_requested = done.requested;
        stats.faults = done.faults;
        stats.fault_latency_p50_us = done.latency_p50_us;
        stats.fault_latency_p99_us = done.latency_p99_us;
        stats.fault_latency_max_us = done.latency_max_us;
        stats.guest_ops_per_sec = done.guest_ops_per_sec;
        self.stats.cpu_seconds.destination += done.cpu_micros as f64 / 1e6;
        self.stats.pages_sent += pushed + stats.pages_sent_on_request;
        self.stats.bytes_on_wire = self.pacer.as_ref().map_or(0, |p| p.bytes()) + urgent_bytes.load(Ordering::Relaxed);
        if done.mismatched > 0 {
            return Err(SourceError::PostcopyCorrupt(done.mismatched));
        }
        self.stats.digest_verified = true;
        Ok(())
    }

    /// The error for what the destination said or did instead of finishing.
    fn postcopy_failure(&self, heard: Heard) -> SourceError {
        match heard {
            Heard::Refused(reason) => SourceError::PostcopyLost(format!("destination refused: {reason}")),
            Heard::Lost(why) => SourceError::PostcopyLost(why),
            Heard::Running(_) | Heard::Done(_) => SourceError::PostcopyLost("the destination spoke out of turn".into()),
        }
    }
}

/// Guest memory of a paused VM, for the threads that send its pages.
#[derive(Clone)]
struct VmPages(Arc<tsubame_vmm::GuestMemory>);

impl VmPages {
    fn of(vm: &dyn SourceVm) -> VmPages {
        VmPages(vm.memory().clone())
    }
}

/// Sends asked-for pages on the connection kept for them.
struct UrgentServer {
    writer: BufWriter<Stream>,
    outstanding: Arc<Mutex<Outstanding>>,
    /// Pages sent, and bytes.
    sent: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

impl UrgentServer {
    fn run(mut self, memory: VmPages, requests: Receiver<Vec<u64>>, heard: Sender<Heard>) {
        let mut builder = PagesBuilder::new(RECORDS_PER_FRAME);
        let mut page = [0u8; PAGE_SIZE];
        let mut out = Vec::new();
        while let Ok(mut pages) = requests.recv() {
            // Take every request queued meanwhile: one write for all.
            pages.extend(requests.try_iter().flatten());
            pages.sort_unstable();
            pages.dedup();
            {
                let mut outstanding = self.outstanding.lock().unwrap();
                for &p in &pages {
                    outstanding.unsent.unset(p);
                }
                // The guest works near where it faulted: push from there.
                if let Some(&last) = pages.last() {
                    outstanding.cursor = last + 1;
                }
            }
            out.clear();
            for chunk in pages.chunks(RECORDS_PER_FRAME) {
                builder.reset(u32::MAX, 0);
                for &index in chunk {
                    if memory::read_page(&memory.0, index, &mut page).is_err() {
                        continue;
                    }
                    if is_zero(&page) {
                        builder.push(index, Encoding::Zero, &[]);
                    } else {
                        builder.push(index, Encoding::Raw, &page);
                    }
                }
                protocol::write_frame(&mut out, FrameKind::PostcopyPages, builder.payload()).expect("Vec writes");
            }
            if let Err(e) = self.writer.write_all(&out).and_then(|_| self.writer.flush()) {
                let _ = heard.send(Heard::Lost(format!("link lost while sending asked-for pages: {e}")));
                return;
            }
            self.sent.fetch_add(pages.len() as u64, Ordering::Relaxed);
            self.bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
        }
    }
}

/// Reads channel 0 from the destination: page requests go to the request
/// server, everything else to the migration thread.
fn spawn_reader(
    mut reader: BufReader<Stream>,
    pages: u64,
    heard: Sender<Heard>,
    requests: Sender<Vec<u64>>,
) -> std::thread::JoinHandle<()> {
    // The destination may say nothing for long while its guest does not
    // fault: only a broken connection ends the wait.
    let _ = reader.get_ref().set_read_timeout(None);
    std::thread::Builder::new()
        .name("postcopy-reader".into())
        .spawn(move || {
            let mut frame = Vec::new();
            loop {
                let event = match protocol::read_frame(&mut reader, &mut frame) {
                    Ok(kind) if SourceState::Postcopy.accepts(kind) || kind == FrameKind::Error => match kind {
                        FrameKind::PageRequest => match PageRequest::decode(&frame, pages) {
                            Ok(request) => {
                                debug_assert!(request.pages.len() <= MAX_REQUEST);
                                if requests.send(request.pages).is_err() {
                                    return;
                                }
                                continue;
                            }
                            Err(e) => Heard::Lost(format!("bad page request: {e}")),
                        },
                        FrameKind::PostcopyRunning => match PostcopyRunning::decode(&frame) {
                            Ok(running) => Heard::Running(running),
                            Err(e) => Heard::Lost(e.to_string()),
                        },
                        FrameKind::PostcopyDone => match PostcopyDone::decode(&frame) {
                            Ok(done) => Heard::Done(done),
                            Err(e) => Heard::Lost(e.to_string()),
                        },
                        _ => Heard::Refused(ErrorMessage::decode(&frame).0),
                    },
                    Ok(other) => Heard::Lost(
                        WireError::Unexpected { got: other, expected: SourceState::Postcopy.expects() }.to_string(),
                    ),
                    Err(e) => Heard::Lost(format!("link lost: {e}")),
                };
                let last = !matches!(event, Heard::Running(_));
                if heard.send(event).is_err() || last {
                    return;
                }
            }
        })
        .expect("spawn post-copy reader")
}

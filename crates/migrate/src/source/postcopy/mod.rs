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
use tsubame_vmm::{memory, DirtyBitmap, GuestMemory, PAGE_SIZE};

use super::send::write_frame_flushed;
use super::vm::SourceVm;
use super::{ms, SourceError, SourceRun};
use crate::protocol::messages::MAX_REQUEST;
use crate::protocol::pages::{Encoding, PagesBuilder, RECORDS_PER_FRAME};
use crate::protocol::{
    self, Digest, ErrorMessage, FrameKind, PageRequest, PostcopyDone, PostcopyRunning, PostcopyStart, Resume,
    ResumeAck, SourceState, WireError,
};
use crate::stats::PostcopyStats;
use crate::transport::{Address, Metered, Stream, TransportError};

/// Pages one background push takes at a time: small, so an asked-for page
/// never waits long for the pusher to look at the requests.
const PUSH_PAGES: usize = 64;

/// The background push runs at a share of the link's rate: while the
/// guest waits on faults, low enough that a shaped link's queue stays
/// empty with the headers counted (0.85 of 1 Gbit/s: fault service p50
/// 35 µs; 0.9: 325 µs; 0.95: 1 ms), else close to the whole link.
const PUSH_SHARE_FAULTING: f64 = 0.85;
const PUSH_SHARE_QUIET: f64 = 0.95;
/// Asked-for pages per second above which the guest counts as faulting.
const FAULTING: f64 = 100.0;

/// Bytes a channel may still hold in flight when the guest is paused for
/// the switch (64 KiB: half a millisecond at 1 Gbit/s); waited for at
/// most a second.
const DRAINED: usize = 64 << 10;

/// How far ahead of its rate the push may burst: an asked-for page queues
/// behind at most this much of it on a shaped link (10 ms bursts put the
/// median fault service at ~1 ms at 1 Gbit/s).
const PUSH_BURST: Duration = Duration::from_millis(1);

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

    /// The frames carrying `pages`, read from a paused VM's memory.
    fn frames(&mut self, memory: &GuestMemory, pages: &[u64]) -> Result<&[u8], SourceError> {
        self.out.clear();
        for chunk in pages.chunks(RECORDS_PER_FRAME) {
            self.builder.reset(u32::MAX, 0);
            for &index in chunk {
                memory::read_page(memory, index, &mut self.page).map_err(tsubame_vmm::VmError::from)?;
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
        // The pages already queued go out while the guest still runs: what
        // it dirties meanwhile is in the dirty log read after the pause.
        // (Draining after the pause cost 80-230 ms of downtime at 1 Gbit/s.)
        let mut writers = self.finish_engine();
        // And through the link: POSTCOPY must not queue behind them, the
        // destination reads it while the guest is paused.
        super::send::drain(&writers, DRAINED, Duration::from_secs(1));
        self.enter(SourceState::StopAndCopy);
        let paused = Instant::now();
        vm.pause()?;
        let mut fresh = vm.dirty_bitmap();
        vm.dirty_log(&mut fresh)?;
        missing.union_with(&fresh);
        if let Some(far) = &self.far_filter {
            far.remove_unneeded(vm.memory(), &mut missing)?;
        }
        // Every page that may differ from its last hash; hashed while the
        // destination already runs (this memory no longer changes).
        self.refresh_digest(&missing);
        if last_iteration.is_none() {
            self.refresh_digest(&DirtyBitmap::full(missing.pages()));
        }
        let pages = missing.count();
        let timeout_ms = self.options.postcopy_timeout.as_millis().min(u32::MAX as u128) as u32;
        let start = PostcopyStart { last_iteration, timeout_ms, missing: missing.clone() };
        let blob = vm.state_blob()?;
        let written = self.disk_written_frames();
        {
            let w = &mut writers[0];
            for payload in &written {
                protocol::write_frame(w, FrameKind::DiskWritten, payload)?;
            }
            protocol::write_frame(w, FrameKind::Postcopy, &start.encode())?;
            write_frame_flushed(w, FrameKind::State, &blob)?;
        }
        // The point of no return: the destination may run the VM now.
        self.enter(SourceState::Postcopy);
        let started_ms = ms(self.start.elapsed());
        self.stats.postcopy =
            Some(PostcopyStats { started_at_ms: started_ms, pages_missing: pages, ..Default::default() });
        self.stats.stop_reason = crate::stats::StopReason::Postcopy;

        let counters = Counters::default();
        let outstanding = Arc::new(Mutex::new(Outstanding { unsent: missing, cursor: 0 }));
        let reader = self.reader.take().expect("connected");
        let urgent = self.urgent.take();
        let mut link = Link::start(vm, writers, reader, urgent, &outstanding, &counters);

        // The destination runs the VM once it says so: the downtime ends.
        // (A cut link here is taken back like any other: a destination
        // takes a RESUME only once it runs the VM.)
        let mut resumes = 0;
        match link.heard.recv_timeout(self.options.io_timeout) {
            Ok(Heard::Running(running)) => {
                self.stats.cpu_seconds.destination = running.cpu_micros as f64 / 1e6;
            }
            Ok(Heard::Lost(why)) => {
                self.enter(SourceState::PostcopyPaused);
                link = self.reconnect(&why, &outstanding, &counters)?;
                resumes += 1;
                self.enter(SourceState::Postcopy);
            }
            Ok(other) => return Err(self.postcopy_failure(other)),
            Err(_) => return Err(SourceError::PostcopyLost("the destination did not say it runs the VM".into())),
        }
        self.stats.downtime_ms = ms(paused.elapsed());

        // Push the rest, a little under the link's rate.
        // (A switch before the first iteration ended has measured nothing:
        // then the cap is the link's rate as far as we know.)
        let measured = self.policy.bandwidth_for(self.options);
        let bandwidth = match self.options.max_bandwidth {
            Some(cap) if measured <= 1.0 => cap as f64,
            _ => measured,
        };
        let mut rate = PushRate {
            pacer: self.pacer.clone().filter(|_| bandwidth > 1.0 && bandwidth.is_finite()),
            bandwidth,
            since: Instant::now(),
            urgent: 0,
        };
        rate.set(PUSH_SHARE_FAULTING);
        let mut frames = PageFrames::new();
        let done = loop {
            match self.push_until_done(&mut link, &outstanding, &mut frames, &counters, &mut rate) {
                Ok(done) => break done,
                Err(Heard::Lost(why)) => {
                    // Both ends keep what they have and wait for the link.
                    self.enter(SourceState::PostcopyPaused);
                    link = self.reconnect(&why, &outstanding, &counters)?;
                    resumes += 1;
                    self.enter(SourceState::Postcopy);
                }
                Err(other) => return Err(self.postcopy_failure(other)),
            }
        };
        drop(link);
        let stats = self.stats.postcopy.as_mut().expect("set at the switch");
        stats.duration_ms = ms(self.start.elapsed()) - started_ms;
        stats.pages_pushed = counters.pushed.load(Ordering::Relaxed);
        stats.pages_sent_on_request = counters.urgent_pages.load(Ordering::Relaxed);
        stats.pages_zero = frames.zero;
        stats.pages_requested = done.requested;
        stats.faults = done.faults;
        stats.fault_latency_p50_us = done.latency_p50_us;
        stats.fault_latency_p99_us = done.latency_p99_us;
        stats.fault_latency_max_us = done.latency_max_us;
        stats.guest_ops_per_sec = done.guest_ops_per_sec;
        stats.resumes = resumes;
        self.stats.cpu_seconds.destination += done.cpu_micros as f64 / 1e6;
        self.stats.pages_sent += stats.pages_pushed + stats.pages_sent_on_request;
        self.stats.bytes_on_wire =
            self.pacer.as_ref().map_or(0, |p| p.bytes()) + counters.urgent_bytes.load(Ordering::Relaxed);
        if done.mismatched > 0 {
            return Err(SourceError::PostcopyCorrupt(done.mismatched));
        }
        self.stats.digest_verified = true;
        Ok(())
    }

    /// Pushes every page not sent yet, then the digest, and waits for the
    /// destination to hold them all. A cut link or a refusal comes back as
    /// what was heard.
    fn push_until_done(
        &mut self,
        link: &mut Link,
        outstanding: &Mutex<Outstanding>,
        frames: &mut PageFrames,
        counters: &Counters,
        rate: &mut PushRate,
    ) -> Result<PostcopyDone, Heard> {
        let vm = self.vm;
        let lost = |e: std::io::Error| Heard::Lost(format!("link lost while pushing pages: {e}"));
        let mut next = 0usize;
        loop {
            if let Ok(event) = link.heard.try_recv() {
                return Err(event);
            }
            rate.adjust(counters.urgent_pages.load(Ordering::Relaxed));
            let batch = outstanding.lock().unwrap().take(PUSH_PAGES);
            if batch.is_empty() {
                break;
            }
            counters.pushed.fetch_add(batch.len() as u64, Ordering::Relaxed);
            let bytes = frames.frames(vm.memory(), &batch).map_err(|e| Heard::Refused(e.to_string()))?;
            let channels = link.writers.len();
            link.writers[next % channels].write_all(bytes).map_err(lost)?;
            next += 1;
        }
        for w in &mut link.writers {
            w.flush().map_err(lost)?;
        }
        let hashes = self.digest.as_ref().expect("pre-copy marked memory").hashes();
        let digest = Digest { region: self.options.digest_region, hashes };
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

    /// Reconnects to the destination after a cut, trying every half second
    /// (or at once when `tsubame migrate --resume` asks) until
    /// `--postcopy-timeout` has passed: then the VM is lost.
    fn reconnect(
        &mut self,
        why: &str,
        outstanding: &Arc<Mutex<Outstanding>>,
        counters: &Counters,
    ) -> Result<Link, SourceError> {
        let vm = self.vm;
        let deadline = Instant::now() + self.options.postcopy_timeout;
        loop {
            let asked = self.progress.take_resume_request();
            // A new address is kept only once it worked: a wrong one
            // changes nothing.
            let to = match &asked {
                Some((Some(to), _)) => to.clone(),
                _ => self.to.clone(),
            };
            match self.resume_link(&to, outstanding) {
                Ok((writers, reader, urgent)) => {
                    self.to = to;
                    if let Some((_, reply)) = asked {
                        let _ = reply.send(Ok(()));
                    }
                    return Ok(Link::start(vm, writers, reader, urgent, outstanding, counters));
                }
                Err(e) => {
                    if let Some((_, reply)) = asked {
                        let _ = reply.send(Err(format!("cannot resume: {e}")));
                    }
                    if Instant::now() >= deadline {
                        return Err(SourceError::PostcopyLost(format!(
                            "{why}; the destination did not come back within {} s ({e})",
                            self.options.postcopy_timeout.as_secs()
                        )));
                    }
                    self.progress.wait_resume_request(Duration::from_millis(500));
                }
            }
        }
    }

    /// One attempt: channel 0 again (RESUME, RESUME_ACK: what the
    /// destination still lacks), then the request connection.
    fn resume_link(&mut self, to: &Address, outstanding: &Mutex<Outstanding>) -> Result<Connections, SourceError> {
        let options = self.options;
        let stream = Stream::connect_with(to, Duration::from_secs(1), &options.security)?;
        stream.set_read_timeout(Some(options.io_timeout))?;
        let mut io = stream.try_clone()?;
        protocol::write_preamble(&mut io, protocol::VERSION)?;
        write_frame_flushed(&mut io, FrameKind::Resume, &Resume { session: self.session, channel: 0 }.encode())?;
        let mut reader = BufReader::new(stream.try_clone()?);
        protocol::read_preamble(&mut reader)?;
        let mut frame = Vec::new();
        let pages = memory::page_count(self.vm.memory());
        match protocol::read_frame(&mut reader, &mut frame)? {
            FrameKind::ResumeAck => {
                let ack = ResumeAck::decode(&frame, pages)?;
                let mut outstanding = outstanding.lock().unwrap();
                outstanding.unsent = ack.missing;
                outstanding.cursor = 0;
            }
            FrameKind::Error => return Err(SourceError::Refused(ErrorMessage::decode(&frame).0)),
            other => return Err(WireError::Unexpected { got: other, expected: "RESUME_ACK" }.into()),
        }
        let pacer = self.pacer.clone().expect("set at setup");
        let writers = vec![BufWriter::with_capacity(1 << 20, Metered::new(stream, pacer))];
        let urgent = Stream::connect_with(to, Duration::from_secs(1), &options.security).and_then(|s| {
            let mut io = s.try_clone().map_err(|e| TransportError::Connect(to.to_string(), e))?;
            let channel = options.channels;
            protocol::write_preamble(&mut io, protocol::VERSION)
                .and_then(|_| {
                    write_frame_flushed(&mut io, FrameKind::Resume, &Resume { session: self.session, channel }.encode())
                })
                .map_err(|e| TransportError::Connect(to.to_string(), e))?;
            Ok(s)
        });
        Ok((writers, reader, urgent.ok()))
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

/// A post-copy link's connections: the data channels' writers, channel
/// 0's reader, the request connection.
type Connections = (Vec<super::send::Writer>, BufReader<Stream>, Option<Stream>);

/// The push's pace: slower while the guest faults often, so its asked-for
/// pages do not queue behind pushed ones.
struct PushRate {
    pacer: Option<Arc<crate::transport::Pacer>>,
    bandwidth: f64,
    since: Instant,
    urgent: u64,
}

impl PushRate {
    fn set(&self, share: f64) {
        if let Some(pacer) = &self.pacer {
            pacer.set_rate(Some((self.bandwidth * share) as u64));
            pacer.set_burst(PUSH_BURST);
        }
    }

    /// Looks at the asked-for pages sent so far every 50 ms.
    fn adjust(&mut self, urgent: u64) {
        let span = self.since.elapsed().as_secs_f64();
        if span >= 0.05 {
            let faulting = urgent.saturating_sub(self.urgent) as f64 / span >= FAULTING;
            self.set(if faulting { PUSH_SHARE_FAULTING } else { PUSH_SHARE_QUIET });
            (self.since, self.urgent) = (Instant::now(), urgent);
        }
    }
}

/// What went out since the switch, counted across links.
#[derive(Default)]
struct Counters {
    pushed: AtomicU64,
    urgent_pages: Arc<AtomicU64>,
    urgent_bytes: Arc<AtomicU64>,
}

/// The connections of the post-copy phase and the threads on them: the
/// data channels (pushed pages), the reader of channel 0 (requests and
/// replies) and the request server on its own connection.
struct Link {
    writers: Vec<super::send::Writer>,
    heard: Receiver<Heard>,
    reader: std::thread::JoinHandle<()>,
}

impl Link {
    fn start(
        vm: &dyn SourceVm,
        writers: Vec<super::send::Writer>,
        reader: BufReader<Stream>,
        urgent: Option<Stream>,
        outstanding: &Arc<Mutex<Outstanding>>,
        counters: &Counters,
    ) -> Link {
        let (heard_tx, heard) = unbounded();
        let (requests_tx, requests) = unbounded::<Vec<u64>>();
        let pages = memory::page_count(vm.memory());
        let reader = spawn_reader(reader, pages, heard_tx.clone(), requests_tx);
        if let Some(stream) = urgent {
            let server = UrgentServer {
                writer: BufWriter::with_capacity(256 << 10, stream),
                outstanding: outstanding.clone(),
                sent: counters.urgent_pages.clone(),
                bytes: counters.urgent_bytes.clone(),
            };
            let memory = vm.memory().clone();
            let _ = std::thread::Builder::new()
                .name("postcopy-urgent".into())
                .spawn(move || server.run(memory, requests, heard_tx));
        }
        Link { writers, heard, reader }
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
    fn run(mut self, memory: Arc<GuestMemory>, requests: Receiver<Vec<u64>>, heard: Sender<Heard>) {
        let mut frames = PageFrames::new();
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
            let out = match frames.frames(&memory, &pages) {
                Ok(out) => out,
                Err(e) => {
                    let _ = heard.send(Heard::Refused(e.to_string()));
                    return;
                }
            };
            if let Err(e) = self.writer.write_all(out).and_then(|_| self.writer.flush()) {
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

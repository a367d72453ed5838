//! The post-copy link: what the destination still lacks, the frames
//! pages go out in, and the thread on channel 0 (the reader, which also
//! serves the asked-for pages).

use std::io::{BufReader, BufWriter, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{unbounded, Receiver, Sender};
use tsubame_codec::batch::BatchCodec;
use tsubame_codec::zero::is_zero;
use tsubame_vmm::{memory, DirtyBitmap, GuestMemory};

use crate::digest::{page_hash, zero_page_hash, DigestFeed, HASHES_HANDED};
use crate::protocol::pages::{Encoding, PagesBuilder, RECORDS_PER_FRAME};
use crate::protocol::MAX_REQUEST;
use crate::protocol::{
    self, ErrorMessage, FrameKind, PageRequest, PostcopyDone, PostcopyInstalled, PostcopyRunning, SourceState,
    WireError,
};
use crate::source::error::SourceError;
use crate::source::pack::FramePacker;
use crate::source::send::Writer;
use crate::source::vm::SourceVm;
use crate::transport::{Pacer, Stream};

/// What the channel-0 reader hears from the destination.
pub(super) enum Heard {
    /// The destination runs the VM; when that was heard.
    Running(PostcopyRunning, std::time::Instant),
    Done(PostcopyDone),
    Refused(String),
    Lost(String),
}

/// What the destination still lacks, as this end knows it.
pub(super) struct Outstanding {
    /// Pages not sent yet since the switch.
    pub(super) unsent: DirtyBitmap,
    /// Where the background push goes on (the page after the last one
    /// asked for, for locality).
    pub(super) cursor: u64,
    /// Counts the links: a request server takes pages only while its link
    /// is the current one. (One left from a cut link took a page after
    /// the reconnection had named it missing again, and wrote it into the
    /// dead connection: the new server then found it sent, and the
    /// destination waited for it for ever.)
    pub(super) link: u64,
}

impl Outstanding {
    /// Takes up to `n` unsent pages from the cursor on, wrapping once.
    pub(super) fn take(&mut self, n: usize) -> Vec<u64> {
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

/// Builds POSTCOPY_PAGES frames of raw, raw-run and zero records from a
/// paused VM, compressed (POSTCOPY_PAGES_COMPRESSED) while that pays.
pub(super) struct PageFrames {
    builder: PagesBuilder,
    out: Vec<u8>,
    /// The digest's hash of each page read since last taken, when
    /// `hash` is set: memory is paused, so the digest need not read the
    /// page again.
    pub(super) hashes: Vec<(u64, u64)>,
    pub(super) hash: bool,
    pub(super) zero: u64,
    pub(super) packer: Option<Packer>,
}

/// How post-copy's frames are compressed: the codec, and the bandwidth
/// at which it must pay.
#[derive(Clone, Copy)]
pub(super) struct Packing {
    pub(super) codec: BatchCodec,
    pub(super) bandwidth: f64,
}

/// Compresses the push's frames, or the asked-for pages', while that
/// pays at the link's bandwidth (a sparse guest's pages, a few words
/// each, shrink ~40 times: less of the link for each, and for the push).
pub(super) struct Packer {
    packer: FramePacker,
    frame: Vec<u8>,
    /// Bytes per second the push goes at.
    pub(super) bandwidth: f64,
    /// Bytes compressed, and what they became.
    pub(super) bytes_in: u64,
    pub(super) bytes_out: u64,
}

impl Packer {
    pub(super) fn new(codec: BatchCodec, bandwidth: f64) -> Packer {
        Packer { packer: FramePacker::new(codec), frame: Vec::new(), bandwidth, bytes_in: 0, bytes_out: 0 }
    }

    /// The codec's name.
    pub(super) fn name(&self) -> &'static str {
        self.packer.codec().name()
    }

    /// Appends `payload` as a compressed frame when the codec is on and
    /// the result is smaller; false when it did not.
    fn pack(&mut self, payload: &[u8], out: &mut Vec<u8>) -> bool {
        if !self.packer.pack(0, payload, self.bandwidth, &mut self.frame) {
            return false;
        }
        self.bytes_in += payload.len() as u64;
        self.bytes_out += self.frame.len() as u64;
        protocol::write_frame(out, FrameKind::PostcopyPagesCompressed, &self.frame).expect("Vec writes");
        true
    }
}

impl PageFrames {
    pub(super) fn new() -> PageFrames {
        PageFrames {
            builder: PagesBuilder::new(RECORDS_PER_FRAME),
            out: Vec::new(),
            hashes: Vec::new(),
            hash: false,
            zero: 0,
            packer: None,
        }
    }

    /// Frames compressed as `packing` says, while that pays.
    pub(super) fn packed(packing: Packing) -> PageFrames {
        PageFrames { packer: Some(Packer::new(packing.codec, packing.bandwidth)), ..PageFrames::new() }
    }

    /// Hands the hashes of the pages read so far to the digest once there
    /// are at least `at_least` (each hand-over wakes the digest's thread).
    pub(super) fn hand_hashes(&mut self, digest: &DigestFeed, at_least: usize) {
        if self.hashes.len() >= at_least.max(1) {
            digest.known(std::mem::take(&mut self.hashes));
        }
    }

    /// A frame with no records: the source is alive while the link is
    /// otherwise quiet.
    pub(super) fn keepalive(&mut self) -> &[u8] {
        self.out.clear();
        self.builder.reset(u32::MAX, 0);
        protocol::write_frame(&mut self.out, FrameKind::PostcopyPages, self.builder.payload()).expect("Vec writes");
        &self.out
    }

    /// The frames carrying `pages`, read from a paused VM's memory:
    /// consecutive pages that are not all zeros go as one raw run. Pages
    /// are read straight into the frame, which goes out from there when
    /// it is the only one (two copies of every page fewer).
    pub(super) fn frames(&mut self, memory: &GuestMemory, pages: &[u64]) -> Result<&[u8], SourceError> {
        self.out.clear();
        let one_frame = pages.len() <= RECORDS_PER_FRAME;
        let mut in_builder = false;
        for chunk in pages.chunks(RECORDS_PER_FRAME) {
            self.builder.reset_leaving(protocol::FRAME_HEADER_LEN, u32::MAX, 0);
            for &index in chunk {
                let page = self.builder.run_page(index);
                memory::read_page(memory, index, page).map_err(tsubame_vmm::VmError::from)?;
                let zero = is_zero(page);
                if self.hash {
                    self.hashes.push((index, if zero { zero_page_hash() } else { page_hash(page) }));
                }
                if zero {
                    self.builder.unpush_page();
                    self.builder.push(index, Encoding::Zero, &[]);
                    self.zero += 1;
                }
            }
            if let Some(packer) = &mut self.packer {
                if packer.pack(self.builder.payload(), &mut self.out) {
                    continue;
                }
            }
            let header = protocol::frame_header(FrameKind::PostcopyPages, self.builder.payload());
            self.builder.room_mut().copy_from_slice(&header);
            if one_frame {
                in_builder = true;
                break;
            }
            self.out.extend_from_slice(self.builder.all());
        }
        Ok(if in_builder { self.builder.all() } else { &self.out })
    }
}

/// A post-copy link's connections: the data channels' writers, channel
/// 0's reader, the request connection.
pub(super) type Connections = (Vec<Writer>, BufReader<Stream>, Option<Stream>);

/// What went out since the switch, counted across links.
#[derive(Default)]
pub(super) struct Counters {
    pub(super) pushed: AtomicU64,
    pub(super) urgent_pages: Arc<AtomicU64>,
    pub(super) urgent_bytes: Arc<AtomicU64>,
    /// Of the asked-for pages sent, those the push had taken.
    pub(super) urgent_again: Arc<AtomicU64>,
    /// The push's codec shrinks its frames to a quarter or less: a page it
    /// took and that is asked for goes again ([`UrgentServer::serve`]).
    pub(super) push_shrinks: Arc<AtomicBool>,
    /// Pages of the push the destination took in, as it last said
    /// (POSTCOPY_INSTALLED).
    pub(super) installed: Arc<AtomicU64>,
}

/// The connections of the post-copy phase and the threads on them: the
/// data channels (pushed pages), and the reader of channel 0 (requests
/// and replies), which sends the asked-for pages on their own connection.
pub(super) struct PostcopyLink {
    pub(super) writers: Vec<Writer>,
    pub(super) heard: Receiver<Heard>,
    pub(super) reader: std::thread::JoinHandle<()>,
    /// Where the senders hand the hashes of the pages they read, when the
    /// digest awaits them.
    pub(super) digest: Option<DigestFeed>,
}

impl PostcopyLink {
    pub(super) fn start(
        vm: &dyn SourceVm,
        (writers, reader, urgent): Connections,
        outstanding: &Arc<Mutex<Outstanding>>,
        counters: &Counters,
        pacer: Option<Arc<Pacer>>,
        digest: Option<DigestFeed>,
        packing: Packing,
    ) -> PostcopyLink {
        let (heard_tx, heard) = unbounded();
        let pages = memory::page_count(vm.memory());
        let server = urgent.map(|stream| {
            let mut frames = PageFrames::packed(packing);
            frames.hash = digest.is_some();
            UrgentServer {
                link: outstanding.lock().unwrap().link,
                writer: BufWriter::with_capacity(256 << 10, stream),
                memory: vm.memory().clone(),
                frames,
                outstanding: outstanding.clone(),
                sent: counters.urgent_pages.clone(),
                bytes: counters.urgent_bytes.clone(),
                again: counters.urgent_again.clone(),
                push_shrinks: counters.push_shrinks.clone(),
                pacer,
                digest: digest.clone(),
            }
        });
        let reader = spawn_reader(reader, pages, heard_tx, server, counters.installed.clone());
        PostcopyLink { writers, heard, reader, digest }
    }
}

/// Sends asked-for pages on the connection kept for them.
struct UrgentServer {
    /// The link it serves ([`Outstanding::link`]).
    link: u64,
    writer: BufWriter<Stream>,
    memory: Arc<GuestMemory>,
    frames: PageFrames,
    outstanding: Arc<Mutex<Outstanding>>,
    /// Pages sent, and bytes.
    sent: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
    again: Arc<AtomicU64>,
    /// See [`Counters::push_shrinks`].
    push_shrinks: Arc<AtomicBool>,
    /// The push's pacer: asked-for pages share the link with it.
    pacer: Option<Arc<Pacer>>,
    /// Where the hashes of the pages it reads go.
    digest: Option<DigestFeed>,
}

impl UrgentServer {
    /// Sends `pages` (asked for) that the push has not taken; false once
    /// another link replaced the one it serves.
    fn serve(&mut self, mut pages: Vec<u64>) -> Result<bool, Heard> {
        pages.sort_unstable();
        pages.dedup();
        {
            // A page the push took already is on its way, ahead of
            // anything sent now on the same link: sending it again
            // would only double its bytes (a guest that writes memory
            // in order catches up with the push and faults on the
            // pages in flight, a third of all pages for fill-random).
            // Unless the push compresses well: then each of its frames
            // carries many pages, the destination installs them in order,
            // and a page behind a few hundred kilobytes of them waited
            // 20-30 ms there (a bwmem guest at 10 Gbit/s, whose pages
            // shrink ~250 times), while sending it again costs little.
            let resend = self.push_shrinks.load(Ordering::Relaxed);
            let mut outstanding = self.outstanding.lock().unwrap();
            if outstanding.link != self.link {
                return Ok(false);
            }
            let mut again = 0;
            pages.retain(|&p| {
                let unsent = outstanding.unsent.get(p);
                outstanding.unsent.unset(p);
                again += u64::from(!unsent && resend);
                unsent || resend
            });
            self.again.fetch_add(again, Ordering::Relaxed);
            // The guest works near where it faulted: push from there.
            if let Some(&last) = pages.last() {
                outstanding.cursor = last + 1;
            }
        }
        if pages.is_empty() {
            return Ok(true);
        }
        let out = self.frames.frames(&self.memory, &pages).map_err(|e| Heard::Refused(e.to_string()))?;
        if let Err(e) = self.writer.write_all(out).and_then(|_| self.writer.flush()) {
            return Err(Heard::Lost(format!("link lost while sending asked-for pages: {e}")));
        }
        if let Some(pacer) = &self.pacer {
            pacer.charge(out.len());
        }
        self.sent.fetch_add(pages.len() as u64, Ordering::Relaxed);
        self.bytes.fetch_add(out.len() as u64, Ordering::Relaxed);
        if let Some(digest) = &self.digest {
            self.frames.hand_hashes(digest, HASHES_HANDED);
        }
        Ok(true)
    }
}

/// Reads channel 0 from the destination: it sends the pages asked for
/// itself (a hand-off to another thread cost a wake-up per fault), those
/// of every request already read in one write; everything else goes to
/// the migration thread.
fn spawn_reader(
    mut reader: BufReader<Stream>,
    pages: u64,
    heard: Sender<Heard>,
    mut server: Option<UrgentServer>,
    installed: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    // The destination may say nothing for long while its guest does not
    // fault: only a broken connection ends the wait.
    let _ = reader.get_ref().set_read_timeout(None);
    std::thread::Builder::new()
        .name("postcopy-reader".into())
        .spawn(move || {
            let mut frame = Vec::new();
            let mut asked = Vec::new();
            loop {
                // Before waiting for more: the pages of the requests read.
                if !asked.is_empty() && reader.buffer().is_empty() {
                    let Some(server) = &mut server else { return };
                    match server.serve(std::mem::take(&mut asked)) {
                        Ok(true) => {}
                        Ok(false) => return,
                        Err(event) => {
                            let _ = heard.send(event);
                            return;
                        }
                    }
                }
                let event = match protocol::read_frame(&mut reader, &mut frame) {
                    Ok(kind) if SourceState::Postcopy.accepts(kind) || kind == FrameKind::Error => match kind {
                        FrameKind::PageRequest => match PageRequest::decode(&frame, pages) {
                            Ok(request) => {
                                debug_assert!(request.pages.len() <= MAX_REQUEST);
                                asked.extend(request.pages);
                                continue;
                            }
                            Err(e) => Heard::Lost(format!("bad page request: {e}")),
                        },
                        FrameKind::PostcopyInstalled => match PostcopyInstalled::decode(&frame) {
                            Ok(report) => {
                                // Reports from threads of its own may pass each other.
                                installed.fetch_max(report.pages, Ordering::Relaxed);
                                continue;
                            }
                            Err(e) => Heard::Lost(format!("bad installed count: {e}")),
                        },
                        FrameKind::PostcopyRunning => match PostcopyRunning::decode(&frame) {
                            Ok(running) => Heard::Running(running, std::time::Instant::now()),
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
                let last = !matches!(event, Heard::Running(..));
                if heard.send(event).is_err() || last {
                    return;
                }
            }
        })
        .expect("spawn post-copy reader")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::pages::for_each_record;
    use tsubame_vmm::PAGE_SIZE;

    #[test]
    fn consecutive_pages_go_as_one_raw_run() {
        let memory = memory::create(8 << 20, false).unwrap();
        let mark = |page: u64| (page % 255 + 1) as u8;
        for page in [1u64, 2, 3, 5, 7, 8, 11].into_iter().chain(100..400) {
            memory::write(&memory, page * PAGE_SIZE as u64 + 100, &[mark(page)]).unwrap();
        }
        let records = |out: &[u8]| {
            let (mut out, mut payload, mut records) = (out, Vec::new(), Vec::new());
            while !out.is_empty() {
                assert_eq!(protocol::read_frame(&mut out, &mut payload).unwrap(), FrameKind::PostcopyPages);
                for_each_record(&payload, 2048, PAGE_SIZE, |r| {
                    // Each page of a run is its own, in order.
                    for (page, data) in (r.page_index..).zip(r.data.chunks_exact(PAGE_SIZE)) {
                        assert_eq!(data[100], mark(page));
                    }
                    records.push((r.page_index, r.encoding, r.data.len() / PAGE_SIZE));
                    Ok(())
                })
                .unwrap();
            }
            records
        };
        let mut frames = PageFrames::new();
        let out = frames.frames(&memory, &[1, 2, 3, 4, 5, 7, 8, 10, 11]).unwrap().to_vec();
        let expected = [
            (1, Encoding::RawRun, 3),
            (4, Encoding::Zero, 0),
            (5, Encoding::Raw, 1),
            (7, Encoding::RawRun, 2),
            (10, Encoding::Zero, 0),
            (11, Encoding::Raw, 1),
        ];
        assert_eq!(records(&out), expected);
        assert_eq!(frames.zero, 2);
        // More pages than a frame holds: two frames.
        let pages: Vec<u64> = (100..400).collect();
        let out = frames.frames(&memory, &pages).unwrap().to_vec();
        assert_eq!(records(&out), [(100, Encoding::RawRun, RECORDS_PER_FRAME), (356, Encoding::RawRun, 44)]);
    }
}

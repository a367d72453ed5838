//! The receiver's state machine ([`ReceiverState`]) over channel 0: HELLO,
//! the pre-copy iterations, STATE, the digest check and its repair passes,
//! READY, COMMIT. Page frames go to the shard decoders through
//! [`Dispatcher`]; extra channels are read by their own threads.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crossbeam_channel::bounded;
use tsubame_codec::{CodecList, PageDecoder};
use tsubame_farmem::FarMap;
use tsubame_vmm::memory::{self, GuestMemory};
use tsubame_vmm::{DirtyBitmap, PAGE_SIZE};

use super::apart::Apart;
use super::apply::{PageMarks, ShardWorker};
use super::dispatch::{channel_loop, ChannelSource, Dispatcher, LeasedFrame, ShardWork, Shared};
use super::error::ReceiveError;
use super::landing::{announce_running, Landing, WarmDisk};
use super::leftovers::Leftovers;
use super::options::ReceiveOptions;
use super::postcopy::{self, write_flushed, BackChannel, PostcopyHandle, PostcopyShared, Reconnect};
use super::warm::WarmFill;
use crate::buffer_budget::BufferBudget;
use crate::digest::{BackgroundDigest, FarPageHashes};
use crate::protocol::far::{FarMemory, FarPages};
use crate::protocol::messages::expect_empty;
use crate::protocol::{
    self, shard_codecs, Digest, DigestUpdate, DiskWritten, ErrorMessage, FrameKind, Hello, Mismatch, PostcopyRunning,
    PostcopyStart, ReceiverState, Resumed, ShardLayout, WarmBlocks, WarmData, WireError, MAX_REPAIR_ROUNDS,
};
use crate::stats::process_cpu_seconds;
use crate::transport::Stream;

/// Frame buffers each channel keeps in flight.
const BUFFERS_PER_CHANNEL: usize = 8;

/// The receiving end of one migration.
pub(super) struct StreamReceiver<'a> {
    options: &'a ReceiveOptions,
    log: &'a dyn Fn(&str),
    frame: LeasedFrame,
    state: ReceiverState,
    iterations: u32,
    /// This process's CPU time when the connection came.
    cpu_start: f64,
    /// The disk cache a warm migration fills ahead of the VM.
    warm: Option<WarmFill>,
    /// False when the landing never opens storage (disk frames ignored).
    opens_storage: bool,
    /// Held from the digest before the stop (or STATE) to RESUMED.
    quick: Option<tsubame_vmm::cpu_time::QuickWakeups>,
    /// Set with `quick`: the vCPU thread apart from the others.
    apart: Option<Apart>,
}

/// The threads and tables of a migration being received.
struct Session {
    mem: Arc<GuestMemory>,
    shared: Arc<Shared>,
    main: Dispatcher,
    readers: Vec<std::thread::JoinHandle<()>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// The post-copy request connection, when the source may switch.
    urgent: Option<Stream>,
    /// Far memory's pages, for the digest.
    far: Option<Arc<FarPageHashes>>,
    /// The memory's digest, which the decoders hand the hash of each page
    /// they write: after STATE nothing is left to hash before READY.
    digest: BackgroundDigest,
}

/// How pre-copy's memory phase ended.
enum MemoryEnd {
    /// STATE arrived, the VM's state is loaded and the memory verified:
    /// the two digests compared, to free after RESUMED.
    Verified([Vec<u64>; 2]),
    /// The source switched to post-copy (true: with POSTCOPY at once), or
    /// is about to (false: POSTCOPY_PREPARE).
    Postcopy(PostcopyStart, bool),
}

/// How long the switch's last wait spins before it sleeps: the source
/// answers POSTCOPY_PREPARED within a millisecond or so.
const SWITCH_SPIN: Duration = Duration::from_millis(5);

/// What a receive ended with.
pub(super) struct Outcome {
    /// Iterations received.
    pub(super) iterations: u32,
    /// The post-copy phase, when the source switched to it.
    pub(super) postcopy: Option<PostcopyHandle>,
    /// To drop once the source heard that the VM runs here.
    pub(super) leftovers: Option<Leftovers>,
}

impl<'a> StreamReceiver<'a> {
    pub(super) fn new(options: &'a ReceiveOptions, log: &'a dyn Fn(&str)) -> Self {
        let budget = BufferBudget::new(options.in_flight_limit);
        StreamReceiver {
            options,
            log,
            frame: LeasedFrame::new(budget, Arc::default()),
            state: ReceiverState::Hello,
            iterations: 0,
            cpu_start: process_cpu_seconds(),
            warm: None,
            opens_storage: true,
            quick: None,
            apart: None,
        }
    }

    /// The next frame on channel 0, which the current state must accept;
    /// the source's ERROR ends the migration with its reason.
    fn next(&mut self, reader: &mut impl Read) -> Result<FrameKind, ReceiveError> {
        let kind = self.frame.read(reader)?;
        self.state.check(kind)?;
        if kind == FrameKind::Error {
            return Err(ReceiveError::SourceAborted(ErrorMessage::decode(&self.frame.buf).0));
        }
        Ok(kind)
    }

    /// Runs the exchange to COMMIT, or to the switch to post-copy (then
    /// the VM runs here and the returned handle follows the rest).
    pub(super) fn run(
        mut self,
        mut reader: Box<dyn Read + Send>,
        writer: &BackChannel,
        landing: &mut dyn Landing,
        channels: Option<&ChannelSource>,
    ) -> Result<Outcome, ReceiveError> {
        write_flushed(writer, |w| protocol::write_preamble(w, protocol::VERSION))?;
        protocol::read_preamble(&mut reader)?;
        self.next(&mut reader)?;
        let hello = Hello::decode(&self.frame.buf)?;
        self.opens_storage = landing.opens_storage();
        let session = self.accept(&hello, &mut reader, writer, landing, channels)?;
        self.state = ReceiverState::Iterating;
        let result = self.receive_memory(&mut reader, writer, &session, landing);
        let Session { mem, shared, main, readers, workers, urgent, far, digest } = session;
        // Post-copy starts from the hash of every page held now.
        let postcopy = matches!(result, Ok(MemoryEnd::Postcopy(..)));
        let (held, digest) = if postcopy { (Some(digest.take_page_hashes()), None) } else { (None, Some(digest)) };
        shared.done.store(true, Ordering::Release);
        let end = match result {
            Ok(end) => end,
            Err(e) => {
                Apart::end(self.apart.take(), landing);
                drop(main);
                drop(digest);
                shared.fail(ReceiveError::ThreadStopped);
                for r in readers {
                    let _ = r.join();
                }
                // Their queues closed with the readers: no decoder outlives
                // a failed migration (still holding its memory).
                for w in workers {
                    let _ = w.join();
                }
                return Err(e);
            }
        };
        // With one channel the decoders' queues closed with `main`: they
        // are joined. Extra channels' readers and their decoders end when
        // the source closes its channels; nothing waits for that.
        let decoders = if readers.is_empty() { workers } else { Vec::new() };
        drop(readers);
        let mut leftovers = Leftovers { _digest: digest, main: Some(main), decoders, _buffers: None, _hashes: None };
        match end {
            MemoryEnd::Verified(hashes) => {
                leftovers._hashes = Some(hashes);
                // From READY to RESUMED every step blocks or ends within a
                // millisecond: this thread runs without waiting for a CPU
                // (behind the vCPU it just started, RESUMED went out up to
                // 2.4 ms late), as in post-copy's switch.
                let realtime = tsubame_vmm::cpu_time::realtime_thread();
                Apart::free_this_thread(&self.apart);
                write_flushed(writer, |w| protocol::write_frame(w, FrameKind::Ready, &[]))?;
                self.state = ReceiverState::Ready;
                (self.log)("memory verified; ready, waiting for commit");
                self.next(&mut reader)?;
                expect_empty(FrameKind::Commit, &self.frame.buf)?;
                landing.start()?;
                // The VM runs here now, whether RESUMED arrives or not.
                let resumed = Resumed { cpu_micros: ((process_cpu_seconds() - self.cpu_start) * 1e6) as u64 };
                let _ = write_flushed(writer, |w| protocol::write_frame(w, FrameKind::Resumed, &resumed.encode()));
                drop((realtime, self.quick.take()));
                Apart::end(self.apart.take(), landing);
                self.state = ReceiverState::Committed;
                (self.log)("committed; the VM runs here now");
                leftovers._buffers = Some((reader, std::mem::take(&mut self.frame.buf)));
                Ok(Outcome { iterations: self.iterations, postcopy: None, leftovers: Some(leftovers) })
            }
            MemoryEnd::Postcopy(start, switching) => {
                drop((leftovers, self.quick.take()));
                Apart::end(self.apart.take(), landing);
                let held = held.expect("hashed for post-copy");
                let timeout = Duration::from_millis(start.timeout_ms as u64);
                // Far pages fault in from the memory host, not the source.
                let far = match (landing.far_reader()?, far) {
                    (Some(reader), Some(map)) => Some((reader, map)),
                    _ => None,
                };
                let huge = self.options.hugepages;
                let postcopy = PostcopyShared::start(mem, &start.missing, held, writer.clone(), timeout, far, huge)?;
                let _ = shared.postcopy.set(postcopy.clone());
                // From here to the VM's start every step is on the switch's
                // path: this thread runs without waiting for a CPU (each
                // step blocks or ends within a millisecond).
                let realtime = tsubame_vmm::cpu_time::realtime_thread();
                if !switching {
                    // The guest still runs at the source: drop what went
                    // stale there in rounds, so that the pause adds little.
                    self.state = ReceiverState::Preparing;
                    loop {
                        write_flushed(writer, |w| protocol::write_frame(w, FrameKind::PostcopyPrepared, &[]))?;
                        if let Some(channels) = channels {
                            channels.first.wait_readable_closely(SWITCH_SPIN);
                        }
                        let kind = self.next(&mut reader)?;
                        if kind == FrameKind::DiskWritten {
                            self.disk_written()?;
                            continue;
                        }
                        let more = PostcopyStart::decode(&self.frame.buf, postcopy.pages())?;
                        postcopy.add_missing(&more.missing)?;
                        if kind == FrameKind::Postcopy {
                            break;
                        }
                    }
                }
                self.state = ReceiverState::Switching;
                self.next(&mut reader)?;
                let state = std::mem::take(&mut self.frame.buf);
                let disk_cache = self.finish_warm();
                let running = PostcopyRunning { cpu_micros: ((process_cpu_seconds() - self.cpu_start) * 1e6) as u64 };
                // The VM runs here from now on, whether this reaches the
                // source or not: a cut link shows on channel 0's reader and
                // the phase waits for the source to come back. The vCPU
                // thread says it as it goes into the guest (this thread
                // woke up 30-90 µs later).
                landing.run_postcopy(&state, disk_cache, announce_running(writer.clone(), running))?;
                drop(realtime);
                self.state = ReceiverState::Postcopy;
                (self.log)(&format!(
                    "post-copy: the VM runs here; {} pages to come from the source",
                    start.missing.count()
                ));
                // A cut link comes back through the listener the
                // migration came in on.
                let reconnect = match channels.and_then(|c| c.listener) {
                    Some(listener) => Some(Reconnect {
                        listener: listener.try_clone()?,
                        security: self.options.security.clone(),
                        session: hello.session,
                        urgent_channel: hello.channels,
                    }),
                    None => None,
                };
                let handle = postcopy::run(postcopy, reader, urgent, hello.digest_region, reconnect);
                Ok(Outcome { iterations: self.iterations, postcopy: Some(handle), leftovers: None })
            }
        }
    }

    /// DISK_WRITTEN (in `self.frame`): blocks whose early copies in the
    /// warm cache are stale.
    fn disk_written(&self) -> Result<(), ReceiveError> {
        if !self.opens_storage {
            return Ok(());
        }
        let Some(warm) = self.warm.as_ref() else {
            return Err(WireError::Unexpected { got: FrameKind::DiskWritten, expected: "WARM_BLOCKS first" }.into());
        };
        warm.written(&DiskWritten::decode(&self.frame.buf, warm.size_bytes())?);
        Ok(())
    }

    /// The warm disk cache, filling stopped, for the VM's disk.
    fn finish_warm(&mut self) -> Option<WarmDisk> {
        let (spec, cache, listed, stats) = self.warm.take()?.finish();
        (self.log)(&format!(
            "warm cache: {} of {listed} listed blocks read ahead, {} dropped as written at the source since",
            stats.warmed_blocks, stats.invalidated_blocks
        ));
        Some(WarmDisk { spec, cache })
    }

    /// Checks HELLO, creates the landing, says ACCEPT, accepts the extra
    /// channels and starts the threads that receive and apply pages.
    fn accept(
        &mut self,
        hello: &Hello,
        mut reader: &mut dyn Read,
        writer: &BackChannel,
        landing: &mut dyn Landing,
        channels: Option<&ChannelSource>,
    ) -> Result<Session, ReceiveError> {
        if let Some(expected) = self.options.expect_memory {
            if expected != hello.memory_bytes {
                return Err(ReceiveError::Mismatch(format!(
                    "memory size mismatch: the source VM has {} bytes, this destination takes {} (--memory)",
                    hello.memory_bytes, expected
                )));
            }
        }
        let codecs: CodecList = hello
            .codecs
            .parse()
            .map_err(|e| ReceiveError::Mismatch(format!("source's codecs '{}': {e}", hello.codecs)))?;
        if hello.extra_connections() > 0 && channels.is_none_or(|c| c.listener.is_none()) {
            return Err(ReceiveError::Mismatch(format!(
                "the source wants {} connections; this receiver takes one",
                hello.extra_connections() + 1
            )));
        }
        let mem = landing.create(hello.memory_bytes)?;
        write_flushed(writer, |w| protocol::write_frame(w, FrameKind::Accept, &[]))?;
        let marks = Arc::new(PageMarks::new(memory::page_count(&mem)));
        let far = if hello.far_memory() {
            let map = self.receive_far_map(&mut reader, hello.memory_bytes)?;
            // A page that comes back and changes at the source may arrive as
            // a zero record: it must overwrite what would otherwise be read
            // from the memory host.
            map.far.iter().for_each(|page| marks.touch(page));
            let hashes = Arc::new(FarPageHashes { far: map.far.clone(), hashes: map.hashes.clone() });
            (self.log)(&format!(
                "far memory: {} MiB of the VM live on {}",
                (map.far.count() * 4096) >> 20,
                map.stores.join(" and ")
            ));
            if self.opens_storage {
                landing.far_memory(map)?;
            }
            Some(hashes)
        } else {
            None
        };
        (self.log)(&format!(
            "receiving a VM with {} MiB of memory over {} channel(s)",
            hello.memory_bytes >> 20,
            hello.channels
        ));
        let mut extra = match channels {
            Some(source) => source.accept(
                hello.session,
                hello.extra_connections() + 1,
                self.options.io_timeout,
                &self.options.security,
            )?,
            None => Vec::new(),
        };
        // The post-copy request connection comes after the data channels.
        let urgent = if hello.postcopy() { extra.pop() } else { None };

        let shared = Arc::new(Shared {
            applied: Mutex::new(vec![0; hello.shards as usize]),
            changed: Condvar::new(),
            failure: Mutex::new(None),
            streams: Mutex::new(extra.iter().map(|s| s.try_clone()).collect::<Result<_, _>>()?),
            done: AtomicBool::new(false),
            stopped: self.frame.stopped.clone(),
            budget: self.frame.budget.clone(),
            postcopy: Default::default(),
        });
        if let Some(source) = channels {
            shared.streams.lock().unwrap().push(source.first.try_clone()?);
        }
        // Started once every channel is in: building its tables (9 MiB
        // for 4 GiB) before that slowed an idle 4 GiB migration from 50
        // to 64 ms on this 2-core host (setup and first iteration).
        let digest = match &far {
            Some(far) => BackgroundDigest::start(mem.clone(), hello.digest_region, Some(far.clone())),
            // Memory just mapped: the digest follows what lands.
            None => BackgroundDigest::start_fresh(mem.clone(), hello.digest_region),
        };
        let shard_list = shard_codecs(&codecs, hello.shards, hello.memory_bytes);
        // Only shards and channels matter here: pages arrive in frames.
        let layout = ShardLayout { batch_pages: 1, shards: hello.shards, channels: hello.channels };
        let mut to_shards = Vec::new();
        let mut workers = Vec::new();
        for shard in 0..hello.shards {
            let (tx, rx) = bounded::<ShardWork>(BUFFERS_PER_CHANNEL);
            let worker = ShardWorker {
                shard,
                mem: mem.clone(),
                granularity: hello.granularity as usize,
                marks: marks.clone(),
                digest: digest.feed(),
                decoder: PageDecoder::new(&shard_list),
                shared: shared.clone(),
            };
            workers.push(
                std::thread::Builder::new()
                    .name(format!("decode-{shard}"))
                    .spawn(move || worker.run(rx))
                    .expect("spawn decoder"),
            );
            to_shards.push(tx);
        }
        let dispatcher = |channel: u16| {
            let (pool_tx, pool_rx) = bounded(BUFFERS_PER_CHANNEL + 2);
            for _ in 0..BUFFERS_PER_CHANNEL + 2 {
                pool_tx.send(Vec::new()).expect("pool has room");
            }
            Dispatcher { channel, layout, to_shards: to_shards.clone(), pool_tx, pool_rx }
        };
        let mut readers = Vec::new();
        for (i, stream) in extra.into_iter().enumerate() {
            let dispatch = dispatcher(i as u16 + 1);
            let shared = shared.clone();
            let bytes = channels.map(|c| c.bytes.clone()).unwrap_or_default();
            readers.push(
                std::thread::Builder::new()
                    .name(format!("receive-{}", i + 1))
                    .spawn(move || channel_loop(stream, dispatch, bytes, shared))
                    .expect("spawn channel reader"),
            );
        }
        let main = dispatcher(0);
        Ok(Session { mem, shared, main, readers, workers, urgent, far, digest })
    }

    /// FAR_MEMORY and its FAR_PAGES, on channel 0 before any page.
    fn receive_far_map(&mut self, reader: &mut impl Read, memory_bytes: u64) -> Result<FarMap, ReceiveError> {
        self.state = ReceiverState::FarMap;
        let pages = memory_bytes.div_ceil(PAGE_SIZE as u64);
        let kind = self.next(reader)?;
        if kind != FrameKind::FarMemory {
            return Err(WireError::Unexpected { got: kind, expected: "FAR_MEMORY" }.into());
        }
        let setup = FarMemory::decode(&self.frame.buf, memory_bytes)?;
        let mut far = DirtyBitmap::new(pages);
        let mut hashes = vec![0u128; pages as usize];
        let mut named = 0;
        let mut next_page = 0;
        while named < setup.far_pages {
            let kind = self.next(reader)?;
            if kind != FrameKind::FarPages {
                return Err(WireError::Unexpected { got: kind, expected: "FAR_PAGES" }.into());
            }
            let run = FarPages::decode(&self.frame.buf, pages)?;
            if run.first_page < next_page {
                return Err(WireError::bad("far_pages.first", "runs out of order").into());
            }
            next_page = run.first_page + run.words.len() as u64 * 64;
            let first_word = (run.first_page / 64) as usize;
            far.words_mut()[first_word..first_word + run.words.len()].copy_from_slice(&run.words);
            let set = far.words()[first_word..first_word + run.words.len()].iter();
            let mut run_hashes = run.hashes.iter();
            for (w, &word) in set.enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let page = (first_word + w) as u64 * 64 + bits.trailing_zeros() as u64;
                    bits &= bits - 1;
                    hashes[page as usize] = *run_hashes.next().expect("one hash per set bit (decoded)");
                }
            }
            named += run.hashes.len() as u64;
        }
        if named != setup.far_pages {
            return Err(WireError::bad(
                "far_pages",
                format!("{named} pages named, FAR_MEMORY said {}", setup.far_pages),
            )
            .into());
        }
        Ok(FarMap { local_bytes: setup.local_bytes, stores: setup.stores, far, hashes })
    }

    /// Pages until STATE, which is loaded into `landing`, then the digest
    /// check and repair passes.
    fn receive_memory(
        &mut self,
        reader: &mut impl Read,
        writer: &BackChannel,
        session: &Session,
        landing: &mut dyn Landing,
    ) -> Result<MemoryEnd, ReceiveError> {
        let Session { mem, shared, main, digest, .. } = session;
        let with_failure = |e: ReceiveError| shared.take_failure().unwrap_or(e);
        let mut last_iteration = None;
        // A DIGEST sent before the pause: after it only the regions that
        // changed come (DIGEST_UPDATE).
        let regions = memory::size(mem).div_ceil(digest.region() as u64) as usize;
        let mut provisional: Option<Vec<u64>> = None;
        let state: Vec<u8> = loop {
            match self.next(reader).map_err(with_failure)? {
                FrameKind::IterationEnd => {
                    last_iteration = Some(main.end(&self.frame.buf).map_err(with_failure)?);
                    self.iterations += 1;
                }
                FrameKind::State => {
                    // A copy: the buffer, grown for the largest batch, stays
                    // for the frames to come (freeing 4 MiB of it took
                    // 0.09-0.13 ms of the stop).
                    break self.frame.buf.clone();
                }
                FrameKind::Digest => {
                    provisional = Some(Digest::decode(&self.frame.buf, digest.region(), regions)?.hashes);
                    self.quick.get_or_insert_with(tsubame_vmm::cpu_time::quick_wakeups);
                    let threads = session.readers.iter().chain(&session.workers);
                    self.apart = self.apart.take().or_else(|| Apart::start(threads, digest, landing));
                    shared.catch_up(last_iteration, digest, writer).map_err(with_failure)?;
                }
                FrameKind::WarmBlocks | FrameKind::DiskWritten | FrameKind::WarmData if !self.opens_storage => {}
                FrameKind::WarmData => {
                    let Some(warm) = self.warm.as_ref() else {
                        return Err(
                            WireError::Unexpected { got: FrameKind::WarmData, expected: "WARM_BLOCKS first" }.into()
                        );
                    };
                    warm.data(&WarmData::decode(&self.frame.buf, warm.size_bytes())?);
                }
                FrameKind::WarmBlocks => {
                    let list = WarmBlocks::decode(&self.frame.buf)?;
                    match self.warm.as_mut() {
                        Some(warm) => warm.add(list)?,
                        None => self.warm = Some(WarmFill::start(list, self.log)?),
                    }
                }
                FrameKind::DiskWritten => self.disk_written()?,
                kind @ (FrameKind::Postcopy | FrameKind::PostcopyPrepare) => {
                    let start = PostcopyStart::decode(&self.frame.buf, memory::page_count(mem))?;
                    if let Some(last) = start.last_iteration {
                        // Every channel's pages of it are applied first.
                        shared.wait_applied(last)?;
                    }
                    return Ok(MemoryEnd::Postcopy(start, kind == FrameKind::Postcopy));
                }
                kind => {
                    if let Some(apart) = &mut self.apart {
                        apart.received(self.frame.buf.len(), session.readers.iter().chain(&session.workers), digest);
                    }
                    main.pages(kind, &mut self.frame).map_err(with_failure)?
                }
            }
        };
        let Some(final_iteration) = last_iteration else {
            return Err(WireError::Unexpected { got: FrameKind::State, expected: "ITERATION_END" }.into());
        };
        self.state = ReceiverState::AwaitDigest;
        self.quick.get_or_insert_with(tsubame_vmm::cpu_time::quick_wakeups);
        // The vCPU's state loads while the last pages land and the digests
        // are compared (0.06-0.08 ms here): it touches no guest memory, and
        // the guest runs only on COMMIT.
        let disk_cache = self.finish_warm();
        landing.restore(&state, disk_cache)?;
        // Every channel's last pages are applied, their hashes handed
        // over, before the digest is read.
        shared.wait_applied(final_iteration)?;
        let mut ours = digest.request_hashes_in_stop().recv().expect("digest thread answers");
        let mut theirs = match self.next(reader)? {
            FrameKind::DigestUpdate => {
                let update = DigestUpdate::decode(&self.frame.buf, digest.region(), ours.len())?;
                let Some(before) = provisional.take() else {
                    return Err(WireError::Unexpected { got: FrameKind::DigestUpdate, expected: "DIGEST" }.into());
                };
                Digest { region: digest.region(), hashes: update.apply(before) }
            }
            _ => Digest::decode(&self.frame.buf, digest.region(), ours.len())?,
        };
        // Verify; on a mismatch ask for those regions again (the repair
        // pass), then compare anew.
        let mut rounds = 0;
        let mut repair_iteration = final_iteration;
        loop {
            let mismatched = theirs.differing(&ours);
            let Some(&first) = mismatched.first() else { break };
            if rounds == MAX_REPAIR_ROUNDS || mismatched.len() > protocol::messages::MAX_MISMATCH {
                return Err(ReceiveError::DigestMismatch {
                    count: mismatched.len(),
                    total: ours.len(),
                    first: first as u64 * digest.region() as u64,
                });
            }
            rounds += 1;
            (self.log)(&format!("memory differs in {} regions; asking for them again", mismatched.len()));
            let regions = mismatched.iter().map(|&r| r as u32).collect();
            write_flushed(writer, |w| protocol::write_frame(w, FrameKind::Mismatch, &Mismatch { regions }.encode()))?;
            self.state = ReceiverState::Repairing;
            loop {
                match self.next(reader).map_err(with_failure)? {
                    FrameKind::IterationEnd => repair_iteration = main.end(&self.frame.buf).map_err(with_failure)?,
                    FrameKind::Digest => break,
                    kind => main.pages(kind, &mut self.frame).map_err(with_failure)?,
                }
            }
            shared.wait_applied(repair_iteration)?;
            ours = digest.hashes();
            theirs = Digest::decode(&self.frame.buf, digest.region(), ours.len())?;
        }
        landing.restored()?;
        Ok(MemoryEnd::Verified([ours, theirs.hashes]))
    }
}

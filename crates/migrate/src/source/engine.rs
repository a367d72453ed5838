//! The engine that runs the stages: fetch (the migration thread) →
//! encode (one [`EncodeStage`] per shard) → send (one [`SendStage`] per
//! channel). Pipelined, each encode and send stage runs in a thread of its
//! own, joined by bounded queues of reusable buffers (GMigrate's three
//! threads; QEMU's multifd); with `--no-pipeline` the same stage code runs
//! in turn on the migration thread.
//!
//! Pages are split into codec shards by page index, in chunks of
//! `batch_pages` (protocol::shard): every page always goes through the
//! same shard, whose encoder owns its codec caches and whose frames travel
//! on one channel in order, so a page's records can never overtake each
//! other however the channels interleave.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use tsubame_vmm::PAGE_SIZE;

use super::busy::{timed, Busy, PipelineWork, StageWork};
use super::encode::{EncodeStage, EncoderSetup, SendItem, ShardEncoder};
use super::error::PipelineError;
use super::fetch::Batch;
use super::send::{SendStage, Writer};
use super::threads::{EncodeLoop, LiveBusy, SendLoop, ToEncoder};
use super::zerocopy::{GuestPages, ZeroCopySender};
use crate::protocol::ShardLayout;
use crate::stats::{PipelineStats, StageStats, ZeroCopyStats};
use crate::transport::Pacer;

/// Knobs of the engine.
pub struct EngineSetup {
    /// Threads and queues, or every stage in turn on the caller's thread.
    pub pipelined: bool,
    /// Buffers per stage (queue depth).
    pub buffers: usize,
    /// `--zero-copy`: guest memory, where the senders take raw pages from.
    pub guest: Option<GuestPages>,
}

/// The least [`Engine::wait_for_link`] lets a socket hold (TCP needs some
/// in flight to keep even a short link busy).
const MIN_LINK_WINDOW: usize = 1 << 20;

/// The stages and their threads, or their state when run in turn.
pub struct Engine {
    layout: ShardLayout,
    pacer: Arc<Pacer>,
    live: Arc<LiveBusy>,
    threads: (u32, u32),
    writers: Vec<Arc<Mutex<Writer>>>,
    zero_copy: bool,
    /// `--zero-copy`'s guest memory, for senders made later ([`Engine::run_in_turn`]).
    guest: Option<GuestPages>,
    /// Whether the stages started in threads of their own.
    started_pipelined: bool,
    /// Each channel's zero-copy state. It belongs to the socket, not to a
    /// send stage: the kernel numbers a socket's zero-copy sends from its
    /// first, so a stage made later ([`Engine::run_in_turn`]) must go on
    /// counting where the last one stopped, or it waits for completions
    /// the kernel reported long ago.
    zero_copy_senders: Vec<Arc<Mutex<ZeroCopySender>>>,
    buffers: usize,
    fetch: StageStats,
    fetch_samples: u64,
    mode: Mode,
    /// Every CPU, while [`Engine::spread_stages`] holds the stages apart.
    spread: Option<Vec<usize>>,
}

enum Mode {
    /// `--no-pipeline`: the same stages, called in turn.
    InTurn {
        encoders: Vec<EncodeStage>,
        senders: Vec<SendStage>,
        batch: Option<Batch>,
        out: Vec<u8>,
        encode: Box<StageStats>,
        send: Box<StageStats>,
    },
    Threads {
        to_encoders: Vec<Sender<ToEncoder>>,
        free_batches: Receiver<Batch>,
        done: Receiver<Result<u64, PipelineError>>,
        encoders: Vec<std::thread::JoinHandle<(ShardEncoder, StageStats)>>,
        senders: Vec<std::thread::JoinHandle<StageStats>>,
    },
}

impl Mode {
    /// The stages run in turn on the caller's thread, filling `batch`,
    /// with these stage statistics so far (encode, send).
    fn in_turn(
        encoders: Vec<EncodeStage>,
        senders: Vec<SendStage>,
        batch: Batch,
        out: Vec<u8>,
        (encode, send): (StageStats, StageStats),
    ) -> Mode {
        Mode::InTurn { encoders, senders, batch: Some(batch), out, encode: Box::new(encode), send: Box::new(send) }
    }
}

/// Room for `pages` pages encoded at worst (raw, with their record
/// headers): an encoder's output buffer.
fn encoded_bytes(pages: usize) -> usize {
    pages * (PAGE_SIZE + 64)
}

/// Channel `channel`'s send stage.
fn send_stage(
    layout: ShardLayout,
    writers: &[Arc<Mutex<Writer>>],
    zero_copy: &[Arc<Mutex<ZeroCopySender>>],
    pacer: &Arc<Pacer>,
    guest: Option<GuestPages>,
    channel: u16,
    keep: usize,
) -> SendStage {
    let carried = layout.shards_of(channel).count();
    let (writer, zero_copy) = (writers[channel as usize].clone(), zero_copy[channel as usize].clone());
    SendStage::new(channel, carried, writer, zero_copy, pacer.clone(), guest, keep)
}

impl Engine {
    /// Starts the stages over `writers` (one per channel).
    pub fn start(
        setup: &EngineSetup,
        encoder: &EncoderSetup,
        writers: Vec<Writer>,
        pacer: Arc<Pacer>,
    ) -> Result<Engine, PipelineError> {
        let layout = encoder.layout;
        let batch_pages = layout.batch_pages as usize;
        let writers: Vec<_> = writers.into_iter().map(|w| Arc::new(Mutex::new(w))).collect();
        let encoders = (0..layout.shards)
            .map(|s| ShardEncoder::new(s, encoder).map(EncodeStage::new))
            .collect::<Result<Vec<_>, _>>()?;
        let live = Arc::new(LiveBusy {
            fetch: Busy::default(),
            encode: Busy::default(),
            send: Busy::default(),
            since: Instant::now(),
            for_senders: Default::default(),
            zero_copy_bytes: batch_pages * PAGE_SIZE,
            for_encoders: Default::default(),
            encoded_in: Default::default(),
            encoded_out: Default::default(),
        });
        let out_capacity = encoded_bytes(batch_pages);
        let zero_copy_senders: Vec<_> = writers.iter().map(|_| Arc::default()).collect();
        let sender = |channel: u16, keep: usize| {
            send_stage(layout, &writers, &zero_copy_senders, &pacer, setup.guest, channel, keep)
        };
        let (threads, mode) = if !setup.pipelined {
            let senders = (0..layout.channels).map(|c| sender(c, 0)).collect();
            let stats = (StageStats::named("encode"), StageStats::named("send"));
            let (batch, out) = (Batch::with_capacity(batch_pages), Vec::with_capacity(out_capacity));
            ((1, 1), Mode::in_turn(encoders, senders, batch, out, stats))
        } else {
            let buffers = setup.buffers.max(1);
            let shards = layout.shards as usize;
            // Each encoder may hold one batch while `buffers` wait in its queue.
            let (free_tx, free_rx) = bounded(shards * (buffers + 1) + 1);
            for _ in 0..shards * (buffers + 1) + 1 {
                free_tx.send(Batch::with_capacity(batch_pages)).expect("pool has room");
            }
            let (done_tx, done_rx) = bounded(4 * (shards + layout.channels as usize));
            let mut to_senders = Vec::new();
            let mut senders = Vec::new();
            let mut out_pools = Vec::new();
            for channel in 0..layout.channels {
                let carried = layout.shards_of(channel).count();
                let (tx, rx) = bounded::<SendItem>(buffers * carried + carried);
                let (pool_tx, pool_rx) = bounded::<Vec<u8>>(buffers * carried + 2 * carried);
                for _ in 0..buffers * carried + 2 * carried {
                    pool_tx.send(Vec::with_capacity(out_capacity)).expect("pool has room");
                }
                // Hold one zero-copy buffer in the kernel at most, so the
                // encoders never run out while we wait for completions.
                let send = SendLoop { stage: sender(channel, 1), input: rx, pool: pool_tx, done: done_tx.clone() };
                let live = live.clone();
                senders.push(
                    std::thread::Builder::new()
                        .name(format!("send-{channel}"))
                        .spawn(move || send.run(&live))
                        .expect("spawn sender"),
                );
                to_senders.push(tx);
                out_pools.push(pool_rx);
            }
            let mut to_encoders = Vec::new();
            let mut handles = Vec::new();
            for stage in encoders {
                let channel = layout.channel(stage.shard()) as usize;
                let (tx, rx) = bounded::<ToEncoder>(buffers);
                let encode = EncodeLoop {
                    stage,
                    input: rx,
                    free_batches: free_tx.clone(),
                    output: to_senders[channel].clone(),
                    out_pool: out_pools[channel].clone(),
                    done: done_tx.clone(),
                };
                let live = live.clone();
                handles.push(
                    std::thread::Builder::new()
                        .name(format!("encode-{}", encode.stage.shard()))
                        .spawn(move || encode.run(&live))
                        .expect("spawn encoder"),
                );
                to_encoders.push(tx);
            }
            let mode = Mode::Threads { to_encoders, free_batches: free_rx, done: done_rx, encoders: handles, senders };
            ((layout.shards as u32, layout.channels as u32), mode)
        };
        Ok(Engine {
            layout,
            pacer,
            live,
            threads,
            writers,
            zero_copy: setup.guest.is_some(),
            guest: setup.guest,
            started_pipelined: setup.pipelined,
            zero_copy_senders,
            buffers: setup.buffers,
            fetch: StageStats::named("fetch"),
            fetch_samples: 0,
            mode,
            spread: None,
        })
    }

    /// The layout of shards and channels.
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// A free batch to fill (waits while every buffer is in flight).
    pub fn take_batch(&mut self) -> Result<Batch, PipelineError> {
        match &mut self.mode {
            Mode::InTurn { batch, .. } => Ok(batch.take().expect("one batch in flight at a time")),
            Mode::Threads { free_batches, .. } => {
                let start = Instant::now();
                let batch = free_batches.recv();
                self.fetch.wait_output_seconds += start.elapsed().as_secs_f64();
                batch.map_err(|_| self.stopped())
            }
        }
    }

    /// A stage thread is gone: the error that stopped it (a write that
    /// failed, say), which waits in `done` behind the stages that merely
    /// stopped after it.
    fn stopped(&self) -> PipelineError {
        if let Mode::Threads { done, .. } = &self.mode {
            let deadline = Instant::now() + Duration::from_secs(2);
            while let Ok(result) = done.recv_deadline(deadline) {
                if let Err(e @ (PipelineError::Write { .. } | PipelineError::Gpu(_))) = result {
                    return e;
                }
            }
        }
        PipelineError::Stopped
    }

    /// Counts fetch work (timed by the caller).
    pub fn fetched(&mut self, busy: StageWork) {
        self.fetch.busy_seconds += busy.wall.as_secs_f64();
        self.fetch.items += 1;
        self.live.fetch.add(busy.wall, busy.cpu);
    }

    /// Each stage's busy time so far, per thread of the stage: the fetch's
    /// and the encoders' are what a page's way through the stages costs
    /// where the link does not bound it; the senders' wall time is
    /// writing and waiting for the socket or the pacer to take the bytes
    /// (near an iteration's length where the link bounds it; a sender
    /// waiting for pages is not busy).
    pub fn work(&self) -> PipelineWork {
        PipelineWork {
            fetch: self.live.fetch.per_thread(1),
            encode: self.live.encode.per_thread(self.threads.0),
            send: self.live.send.per_thread(self.threads.1),
        }
    }

    /// Each stage's busy share of its threads so far, e.g.
    /// "fetch 12% encode 85%×3 send 40%×1".
    pub fn summary(&self) -> String {
        let wall = self.live.since.elapsed().as_secs_f64().max(1e-9);
        let share = |c: &Busy, threads: u32| 100.0 * c.per_thread(threads).wall.as_secs_f64() / wall;
        let (encoders, senders) = self.threads;
        format!(
            "fetch {:.0}% encode {:.0}%×{encoders} send {:.0}%×{senders}",
            share(&self.live.fetch, 1),
            share(&self.live.encode, encoders),
            share(&self.live.send, senders)
        )
    }

    /// Hands a filled batch to its shard's encoder.
    pub fn submit(&mut self, batch: Batch) -> Result<(), PipelineError> {
        let layout = self.layout;
        match &mut self.mode {
            Mode::InTurn { encoders, senders, batch: slot, out, encode, send } => {
                let shard = batch.shard as usize;
                let item = timed(encode, &self.live.encode, || encoders[shard].batch(&batch, std::mem::take(out)));
                encode.items += 1;
                *slot = Some(batch);
                let sender = &mut senders[layout.channel(shard as u16) as usize];
                let (mut released, _) = timed(send, &self.live.send, || sender.send(item?))?;
                send.items += 1;
                *out = released.pop().unwrap_or_default();
                Ok(())
            }
            Mode::Threads { to_encoders, .. } => {
                let queue = &to_encoders[batch.shard as usize];
                self.fetch.sample_queue(queue.len(), &mut self.fetch_samples);
                let start = Instant::now();
                let page_bytes = (batch.len() * PAGE_SIZE) as i64;
                self.live.for_encoders.fetch_add(page_bytes, Ordering::Relaxed);
                let sent = queue.send(ToEncoder::Batch(batch));
                self.fetch.wait_output_seconds += start.elapsed().as_secs_f64();
                if sent.is_err() {
                    self.live.for_encoders.fetch_sub(page_bytes, Ordering::Relaxed);
                }
                sent.map_err(|_| self.stopped())
            }
        }
    }

    /// Ends `iteration` on every channel (ITERATION_END after all its
    /// pages), waits until every channel has written and flushed it, and
    /// returns the records the iteration sent. The stages may use every
    /// CPU again.
    pub fn end_iteration(&mut self, iteration: u32) -> Result<u64, PipelineError> {
        let ended = self.end_on_every_channel(iteration);
        self.gather_stages();
        ended
    }

    fn end_on_every_channel(&mut self, iteration: u32) -> Result<u64, PipelineError> {
        let layout = self.layout;
        let mut total = 0;
        match &mut self.mode {
            Mode::InTurn { encoders, senders, send, .. } => {
                for stage in encoders.iter_mut() {
                    let item = stage.end(iteration);
                    let sender = &mut senders[layout.channel(stage.shard()) as usize];
                    let (_, ended) = timed(send, &self.live.send, || sender.send(item))?;
                    total += ended.unwrap_or(0);
                }
            }
            Mode::Threads { to_encoders, done, .. } => {
                let mut ended = to_encoders.iter().all(|queue| queue.send(ToEncoder::End(iteration)).is_ok());
                for _ in 0..layout.channels {
                    match done.recv() {
                        Ok(Ok(records)) if ended => total += records,
                        Ok(Err(e @ (PipelineError::Write { .. } | PipelineError::Gpu(_)))) => return Err(e),
                        _ => ended = false,
                    }
                    if !ended {
                        break;
                    }
                }
                if !ended {
                    return Err(self.stopped());
                }
            }
        }
        Ok(total)
    }

    /// Channel `c`'s writer, for control frames between iterations (the
    /// pipeline is idle then).
    pub fn writer(&self, channel: u16) -> std::sync::MutexGuard<'_, Writer> {
        self.writers[channel as usize].lock().unwrap()
    }

    /// Channel 0's lowest round trip so far (TCP), unless its sender is
    /// writing just now.
    pub fn round_trip(&self) -> Option<Duration> {
        self.writers[0].try_lock().ok().and_then(|w| super::send::min_rtt(&w))
    }

    /// Waits (at most `limit`) while the pipeline holds more than a link
    /// of `rate` bytes per second carries in its round trip plus `lead`:
    /// the pages waiting for the encoders (at what the encoders made of
    /// pages so far), the bytes of the encoded batches waiting for their
    /// senders, a whole batch for each one being written, and what the
    /// channels' sockets hold. Where the link is the bottleneck a batch
    /// fetched then goes out within about that time, not behind the whole
    /// pipeline's depth (at 1 Gbit/s its queues and buffers held ~300 ms
    /// of pages, stale by the time they arrived); where fetching or
    /// encoding is, the senders are idle and nothing waits. (Waiting until
    /// no batch was queued and no sender writing left a 10 Gbit/s link idle
    /// while the next batch was read and encoded: a 2 GiB kv guest's
    /// migration took 2.04 s watched, 1.72 unwatched, 1.84 watched with
    /// this; medians of 8.) False when `limit` passed first.
    pub fn wait_for_link(&self, rate: f64, lead: Duration, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let rtt = self.round_trip().unwrap_or_default();
        let window = ((rate * (rtt + lead).as_secs_f64()) as usize).max(MIN_LINK_WINDOW);
        let batch_bytes = self.layout.batch_pages as usize * PAGE_SIZE;
        // The encoders' queue counts against a known or measured rate:
        // against the bare floor it held the uncapped demo's fetch to 1 MB.
        let encoding = || if rate > 0.0 { self.live.for_encoders_on_wire() as usize } else { 0 };
        let ahead = || {
            encoding()
                + self.queued_for_senders().max(0) as usize
                + self
                    .writers
                    .iter()
                    .map(|w| {
                        // A sender writing holds the lock: its socket is full.
                        w.try_lock().map_or(batch_bytes, |w| super::send::unsent_bytes(&w).unwrap_or(0))
                    })
                    .sum::<usize>()
        };
        while ahead() > window {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        true
    }

    /// Bytes of the encoded batches waiting for their sender (not those
    /// it writes).
    fn queued_for_senders(&self) -> i64 {
        self.live.for_senders.load(Ordering::Relaxed)
    }

    /// From now on runs the stages in turn on the calling thread: for a
    /// stop of a few pages, whose hand-offs between threads took longer
    /// than the work on them (the encoder, woken on the CPU where the vCPU
    /// thread saved its state, started 0.03-0.06 ms after the fetch handed
    /// it the batch, while the other CPU idled). Called with the guest
    /// still running: joining the threads takes a little while.
    pub fn run_in_turn(&mut self, pages: usize) -> Result<(), PipelineError> {
        if !matches!(self.mode, Mode::Threads { .. }) {
            return Ok(());
        }
        let layout = self.layout;
        let batch_pages = layout.batch_pages as usize;
        let empty = Mode::in_turn(Vec::new(), Vec::new(), Batch::with_capacity(0), Vec::new(), Default::default());
        let Mode::Threads { to_encoders, encoders, senders, free_batches, .. } =
            std::mem::replace(&mut self.mode, empty)
        else {
            unreachable!("matched above");
        };
        let joined = join_threads(to_encoders, encoders, senders);
        self.threads = (1, 1);
        // A thread that died took its shard's encoder (and codec caches).
        let whole = joined.encoders.len() == layout.shards as usize;
        let encoders = if whole { joined.encoders.into_iter().map(EncodeStage::new).collect() } else { Vec::new() };
        let senders = (0..layout.channels)
            .map(|c| send_stage(layout, &self.writers, &self.zero_copy_senders, &self.pacer, self.guest, c, 0))
            .collect();
        // The stop's `pages` are read into a batch the fetch used before
        // and encoded into one buffer, whose memory is written here first,
        // while the guest runs: fresh, it faulted in the stop page by page
        // (~4 µs each on this host, 7 in a 12-page stop).
        let mut batch = free_batches.try_iter().next().unwrap_or_else(|| Batch::with_capacity(batch_pages));
        let pages = pages.min(batch_pages);
        batch.pages[..pages * PAGE_SIZE].fill(0);
        let mut out = Vec::with_capacity(encoded_bytes(batch_pages));
        out.resize(encoded_bytes(pages), 0);
        out.clear();
        self.mode = Mode::in_turn(encoders, senders, batch, out, (joined.encode, joined.send));
        if whole {
            Ok(())
        } else {
            Err(PipelineError::Stopped)
        }
    }

    /// Until the iteration ends, keeps the calling thread (the fetch) on
    /// the CPU it runs on and the stage threads off it: in the stop, with
    /// the guest paused, each can have a CPU, but the scheduler woke an
    /// encoder on the fetch's CPU and left its batches waiting there (0.64
    /// ms each, in a 2.9 ms stop) while the other CPU idled. Nothing
    /// changes with one CPU or the stages run in turn.
    pub fn spread_stages(&mut self) {
        let Some(cpus) = tsubame_vmm::cpu_time::CpuSplit::here() else { return };
        if self.place_stages(&[cpus.here], &cpus.others) {
            self.spread = Some(cpus.all);
        }
    }

    /// Undoes [`Engine::spread_stages`] (on the thread that called it: the
    /// engine's owner, the migration thread, which ends with a failed
    /// migration).
    fn gather_stages(&mut self) {
        if let Some(all) = self.spread.take() {
            self.place_stages(&all, &all);
        }
    }

    /// Lets the calling thread run on `fetch` and the stage threads on
    /// `stages`; false (nothing done) where the stages run in turn.
    fn place_stages(&self, fetch: &[usize], stages: &[usize]) -> bool {
        use std::os::unix::thread::JoinHandleExt;
        use tsubame_vmm::cpu_time::{set_thread_cpus, this_pthread};
        let Mode::Threads { encoders, senders, .. } = &self.mode else { return false };
        set_thread_cpus(this_pthread(), fetch);
        for thread in encoders.iter().map(|h| h.as_pthread_t()).chain(senders.iter().map(|h| h.as_pthread_t())) {
            set_thread_cpus(thread, stages);
        }
        true
    }

    /// Waits (at most `limit`) until every channel's socket holds at most
    /// `keep` bytes the peer has not taken (the pipeline is idle then).
    pub fn drain(&self, keep: usize, limit: Duration) {
        let writers: Vec<_> = self.writers.iter().map(|w| w.lock().unwrap()).collect();
        super::send::drain(&writers.iter().map(|w| &**w).collect::<Vec<_>>(), keep, limit);
    }

    /// Bytes written so far on every channel.
    pub fn bytes(&self) -> u64 {
        self.pacer.bytes()
    }

    /// Stops the threads; returns the encoders (for their counters), the
    /// per-stage statistics and the channels' writers.
    pub fn finish(self) -> (Vec<ShardEncoder>, PipelineStats, Vec<Writer>) {
        let mut fetch = self.fetch;
        fetch.cpu_seconds = 0.0; // the migration thread's CPU is reported on its own
        let (encoders, encode, send) = match self.mode {
            Mode::InTurn { encoders, senders, encode, send, .. } => {
                senders.into_iter().for_each(SendStage::finish);
                (encoders.into_iter().map(|s| s.encoder).collect(), *encode, *send)
            }
            Mode::Threads { to_encoders, encoders, senders, .. } => {
                let joined = join_threads(to_encoders, encoders, senders);
                (joined.encoders, joined.encode, joined.send)
            }
        };
        let mut zero_copy = ZeroCopyStats::default();
        for sender in &self.zero_copy_senders {
            zero_copy.add(&sender.lock().unwrap().stats);
        }
        let mode = if self.started_pipelined { "pipelined" } else { "sequential" };
        let stats = PipelineStats {
            mode: mode.into(),
            channels: self.layout.channels,
            shards: self.layout.shards,
            batch_pages: self.layout.batch_pages,
            buffers: self.buffers,
            stages: vec![fetch, encode, send],
            zero_copy: self.zero_copy.then_some(zero_copy),
        };
        // The stage threads are joined: each writer has one owner again.
        let writers = self
            .writers
            .into_iter()
            .filter_map(|w| Arc::try_unwrap(w).ok().map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner())))
            .collect();
        (encoders, stats, writers)
    }
}

/// What the stage threads leave when joined.
struct Joined {
    encoders: Vec<ShardEncoder>,
    encode: StageStats,
    send: StageStats,
}

/// Stops the stage threads (their queues close) and joins them.
fn join_threads(
    to_encoders: Vec<Sender<ToEncoder>>,
    encoders: Vec<std::thread::JoinHandle<(ShardEncoder, StageStats)>>,
    senders: Vec<std::thread::JoinHandle<StageStats>>,
) -> Joined {
    drop(to_encoders);
    let mut joined = Joined {
        encoders: Vec::new(),
        encode: StageStats { threads: 0, ..StageStats::named("encode") },
        send: StageStats { threads: 0, ..StageStats::named("send") },
    };
    for handle in encoders {
        if let Ok((encoder, stats)) = handle.join() {
            joined.encode.merge(&stats);
            joined.encoders.push(encoder);
        }
    }
    for handle in senders {
        if let Ok(stats) = handle.join() {
            joined.send.merge(&stats);
        }
    }
    joined
}

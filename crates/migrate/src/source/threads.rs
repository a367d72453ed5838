//! The threads of a pipelined [`super::engine::Engine`]: one per shard's
//! encoder, one per channel's sender.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::busy::{timed, Busy};
use super::encode::{EncodeStage, SendItem, ShardEncoder};
use super::error::PipelineError;
use super::fetch::Batch;
use super::send::SendStage;
use crate::stats::{thread_cpu_seconds, StageStats};

/// Busy nanoseconds per stage, updated as the stages work: what the
/// progress bar shows while the final statistics are still in the threads.
pub(super) struct LiveBusy {
    pub(super) fetch: Busy,
    pub(super) encode: Busy,
    pub(super) send: Busy,
    pub(super) since: Instant,
    /// Bytes of the encoded batches handed to a sender's queue and not
    /// taken from it yet (counted here: a handle on the queue itself would
    /// keep it open after its sender stopped, and an encoder would wait on
    /// it for ever). What they put on the wire, not the pages they hold:
    /// counted as whole pages, 1024 sparse pages that lz4 shrank to 80 KB
    /// held a watched first iteration's fetch as if 4 MiB waited.
    pub(super) for_senders: std::sync::atomic::AtomicI64,
    /// What a zero-copy item counts: its pages go from guest memory, not
    /// from its buffer (a whole batch's).
    pub(super) zero_copy_bytes: usize,
}

impl LiveBusy {
    /// The bytes `item` counts in [`LiveBusy::for_senders`].
    pub(super) fn queued_bytes(&self, item: &SendItem) -> i64 {
        (match item {
            SendItem::Frames(frames) => frames.len(),
            SendItem::ZeroCopy(_) => self.zero_copy_bytes,
            SendItem::End { .. } => 0,
        }) as i64
    }
}

/// What the fetch hands an encoder.
pub(super) enum ToEncoder {
    Batch(Batch),
    End(u32),
}

/// An encode stage in its own thread.
pub(super) struct EncodeLoop {
    pub(super) stage: EncodeStage,
    pub(super) input: Receiver<ToEncoder>,
    pub(super) free_batches: Sender<Batch>,
    pub(super) output: Sender<SendItem>,
    pub(super) out_pool: Receiver<Vec<u8>>,
    pub(super) done: Sender<Result<u64, PipelineError>>,
}

impl EncodeLoop {
    pub(super) fn run(mut self, live: &LiveBusy) -> (ShardEncoder, StageStats) {
        let cpu = thread_cpu_seconds();
        let mut stats = StageStats::named("encode");
        let mut samples = 0;
        // An output buffer left empty by the last batch, used again.
        let mut spare: Option<Vec<u8>> = None;
        loop {
            let start = Instant::now();
            let Ok(work) = self.input.recv() else { break };
            stats.wait_input_seconds += start.elapsed().as_secs_f64();
            let item = match work {
                ToEncoder::Batch(batch) => {
                    let start = Instant::now();
                    let Some(out) = spare.take().or_else(|| self.out_pool.recv().ok()) else {
                        let _ = self.done.send(Err(PipelineError::Stopped));
                        break;
                    };
                    stats.wait_output_seconds += start.elapsed().as_secs_f64();
                    let encoded = timed(&mut stats, &live.encode, || self.stage.batch(&batch, out));
                    stats.items += 1;
                    let _ = self.free_batches.send(batch);
                    match encoded {
                        // Nothing changed in the batch (a sub-page guest
                        // that rewrites the same bytes): no hand-off to
                        // the sender, whose wake-up cost more than the
                        // encoding (~30 µs a batch in a stop).
                        Ok(SendItem::Frames(out)) if out.is_empty() => {
                            spare = Some(out);
                            continue;
                        }
                        Ok(item) => item,
                        Err(e) => {
                            let _ = self.done.send(Err(e.into()));
                            break;
                        }
                    }
                }
                ToEncoder::End(iteration) => self.stage.end(iteration),
            };
            stats.sample_queue(self.output.len(), &mut samples);
            let start = Instant::now();
            let queued = live.queued_bytes(&item);
            live.for_senders.fetch_add(queued, Ordering::Relaxed);
            if self.output.send(item).is_err() {
                live.for_senders.fetch_sub(queued, Ordering::Relaxed);
                let _ = self.done.send(Err(PipelineError::Stopped));
                break;
            }
            stats.wait_output_seconds += start.elapsed().as_secs_f64();
        }
        stats.cpu_seconds = thread_cpu_seconds() - cpu;
        (self.stage.encoder, stats)
    }
}

/// A channel's send stage in its own thread.
pub(super) struct SendLoop {
    pub(super) stage: SendStage,
    pub(super) input: Receiver<SendItem>,
    pub(super) pool: Sender<Vec<u8>>,
    pub(super) done: Sender<Result<u64, PipelineError>>,
}

impl SendLoop {
    pub(super) fn run(mut self, live: &LiveBusy) -> StageStats {
        let cpu = thread_cpu_seconds();
        let mut stats = StageStats::named("send");
        loop {
            let start = Instant::now();
            let Ok(item) = self.input.recv() else { break };
            live.for_senders.fetch_sub(live.queued_bytes(&item), Ordering::Relaxed);
            stats.wait_input_seconds += start.elapsed().as_secs_f64();
            if !matches!(item, SendItem::End { .. }) {
                stats.items += 1;
            }
            let sent = timed(&mut stats, &live.send, || self.stage.send(item));
            match sent {
                Ok((released, ended)) => {
                    for buffer in released {
                        let _ = self.pool.send(buffer);
                    }
                    if let Some(records) = ended {
                        let _ = self.done.send(Ok(records));
                    }
                }
                Err(e) => {
                    let _ = self.done.send(Err(e));
                    break;
                }
            }
        }
        self.stage.finish();
        stats.cpu_seconds = thread_cpu_seconds() - cpu;
        stats
    }
}

//! The threads of a pipelined [`super::engine::Engine`]: one per shard's
//! encoder, one per channel's sender.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use tsubame_vmm::PAGE_SIZE;

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
    /// Pages handed to the encoders and not encoded yet, a page's bytes
    /// each: a fetch that ran ahead of a busy encoder had 5 MB of a kv
    /// guest's first iteration waiting there, unseen by
    /// [`super::engine::Engine::wait_for_link`], and a watch that handed
    /// over at 26 ms switched at 63, once all of it had gone out.
    pub(super) for_encoders: std::sync::atomic::AtomicI64,
    /// What the encoders made of the pages so far: bytes of pages in,
    /// bytes queued out ([`LiveBusy::queued_bytes`]).
    pub(super) encoded_in: std::sync::atomic::AtomicU64,
    pub(super) encoded_out: std::sync::atomic::AtomicU64,
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

    /// What the pages waiting for the encoders will likely take on the
    /// wire: their bytes as the encoders shrank those before, whole until
    /// [`ENCODED_SAMPLE`] were encoded (a kv guest's first batch, two
    /// near-empty pages, had its full ones counted at 2 %).
    pub(super) fn for_encoders_on_wire(&self) -> f64 {
        let waiting = self.for_encoders.load(Ordering::Relaxed).max(0) as f64;
        let (into, out) = (self.encoded_in.load(Ordering::Relaxed), self.encoded_out.load(Ordering::Relaxed));
        if into < ENCODED_SAMPLE {
            waiting
        } else {
            waiting * (out as f64 / into as f64).min(1.0)
        }
    }
}

/// Bytes of pages encoded before their shrinking counts for the pages
/// waiting for the encoders.
const ENCODED_SAMPLE: u64 = 1 << 20;

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
                    let page_bytes = (batch.len() * PAGE_SIZE) as i64;
                    live.for_encoders.fetch_sub(page_bytes, Ordering::Relaxed);
                    if let Ok(item) = &encoded {
                        live.encoded_in.fetch_add(page_bytes as u64, Ordering::Relaxed);
                        live.encoded_out.fetch_add(live.queued_bytes(item) as u64, Ordering::Relaxed);
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_waiting_for_the_encoders_count_as_the_encoders_shrank_pages_before() {
        let live = LiveBusy {
            fetch: Busy::default(),
            encode: Busy::default(),
            send: Busy::default(),
            since: Instant::now(),
            for_senders: Default::default(),
            zero_copy_bytes: 0,
            for_encoders: (4 << 20).into(),
            encoded_in: Default::default(),
            encoded_out: Default::default(),
        };
        assert_eq!(live.for_encoders_on_wire(), (4 << 20) as f64, "nothing encoded yet: whole pages");
        // Two near-empty pages shrank 50 times: too few to tell.
        live.encoded_in.store(2 * PAGE_SIZE as u64, Ordering::Relaxed);
        live.encoded_out.store(2 * PAGE_SIZE as u64 / 50, Ordering::Relaxed);
        assert_eq!(live.for_encoders_on_wire(), (4 << 20) as f64);
        // A sample's worth, halved.
        live.encoded_in.store(ENCODED_SAMPLE * 2, Ordering::Relaxed);
        live.encoded_out.store(ENCODED_SAMPLE, Ordering::Relaxed);
        assert_eq!(live.for_encoders_on_wire(), (2 << 20) as f64);
    }
}

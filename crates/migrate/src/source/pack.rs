//! Whole-frame compression (lz4/zstd over a PAGES payload) for pre-copy's
//! encode stage and post-copy's push alike, kept only while it pays at
//! the link's bandwidth.

use tsubame_codec::batch::{BatchCodec, BatchCompressor};
use tsubame_codec::chooser::Payoff;
use tsubame_vmm::cpu_time::thread_cpu_time;

use crate::protocol::pages::CompressedHeader;

/// A batch compressor and the judgement of whether it pays.
pub(crate) struct FramePacker {
    compressor: BatchCompressor,
    payoff: Payoff,
    packed: Vec<u8>,
}

impl FramePacker {
    pub(crate) fn new(codec: BatchCodec) -> FramePacker {
        FramePacker { compressor: BatchCompressor::new(codec), payoff: Payoff::default(), packed: Vec::new() }
    }

    /// The codec in use.
    pub(crate) fn codec(&self) -> BatchCodec {
        self.compressor.codec()
    }

    /// Replaces `frame` with a PAGES_COMPRESSED payload (header, then the
    /// compressed `payload`) when the codec is on; true when that is
    /// smaller than `payload`. `bandwidth` is bytes per second, or not
    /// finite when unknown (then there is no judgement).
    pub(crate) fn pack(&mut self, shard: u16, payload: &[u8], bandwidth: f64, frame: &mut Vec<u8>) -> bool {
        if !self.payoff.enabled() {
            return false;
        }
        // Timed on the thread's CPU clock: a compression that the vCPU or
        // another of our threads preempted read as milliseconds on the
        // wall clock and switched the codec off for 16 MiB.
        let start = thread_cpu_time();
        self.compressor.compress(payload, &mut self.packed);
        let seconds = thread_cpu_time().saturating_sub(start).as_secs_f64();
        let codec = self.compressor.codec();
        frame.clear();
        CompressedHeader { shard, compressor: codec.id(), unpacked_len: payload.len() as u32 }.write(frame);
        frame.extend_from_slice(&self.packed);
        self.payoff.record(seconds, payload.len(), frame.len().min(payload.len()), bandwidth);
        frame.len() < payload.len()
    }
}

//! Whole-frame compression (lz4/zstd over a PAGES payload) for pre-copy's
//! encode stage and post-copy's push alike, kept only while it pays at
//! the link's bandwidth. With `--gpu` and zstd, nvCOMP may compress the
//! frames instead, once it measured faster than the CPU on this stream.

use std::time::Instant;

use tsubame_codec::batch::{BatchCodec, BatchCompressor};
use tsubame_codec::chooser::Payoff;
use tsubame_gpu::nvcomp::{Nvcomp, NvcompAlgo, NvcompBatch};
use tsubame_gpu::GpuError;
use tsubame_vmm::cpu_time::thread_cpu_time;

use crate::protocol::pages::CompressedHeader;

/// A batch compressor and the judgement of whether it pays.
pub(crate) struct FramePacker {
    compressor: BatchCompressor,
    payoff: Payoff,
    packed: Vec<u8>,
    gpu: Option<GpuZstd>,
    /// Where frames are compressed and why, once settled.
    decided: Option<(String, String)>,
}

impl FramePacker {
    pub(crate) fn new(codec: BatchCodec) -> FramePacker {
        FramePacker {
            compressor: BatchCompressor::new(codec),
            payoff: Payoff::default(),
            packed: Vec::new(),
            gpu: None,
            decided: None,
        }
    }

    /// A packer that also tries nvCOMP on the GPU (`--gpu` with zstd):
    /// the first frames are compressed both ways and the faster one keeps
    /// the stream. nvCOMP's LZ4 is not offered: a wire lz4 frame is one
    /// block, and nvCOMP's LZ4 is only fast over many chunks (gpu_bench: a
    /// 4-MiB call of 64-KiB chunks ran at 0.95× one CPU core).
    pub(crate) fn with_gpu(codec: BatchCodec) -> FramePacker {
        let mut packer = FramePacker::new(codec);
        match codec {
            BatchCodec::Zstd(level) => match GpuZstd::open(level) {
                Ok(gpu) => packer.gpu = Some(gpu),
                Err(e) => packer.decided = Some(("zstd on the CPU".into(), format!("nvCOMP not used: {e}"))),
            },
            BatchCodec::Lz4 => {
                let why = "nvCOMP's LZ4 is fast only over many chunks, and an lz4 frame is one block";
                packer.decided = Some(("lz4 on the CPU".into(), why.into()));
            }
        }
        packer
    }

    /// The codec in use.
    pub(crate) fn codec(&self) -> BatchCodec {
        self.compressor.codec()
    }

    /// With `--gpu`: where frames were compressed, and why.
    pub(crate) fn gpu_choice(&self) -> Option<&(String, String)> {
        self.decided.as_ref()
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
        self.compress(payload);
        let seconds = thread_cpu_time().saturating_sub(start).as_secs_f64();
        let codec = self.compressor.codec();
        frame.clear();
        CompressedHeader { shard, compressor: codec.id(), unpacked_len: payload.len() as u32 }.write(frame);
        frame.extend_from_slice(&self.packed);
        self.payoff.record(seconds, payload.len(), frame.len().min(payload.len()), bandwidth);
        frame.len() < payload.len()
    }

    /// Compresses `payload` into `self.packed`: on the CPU, on the GPU once
    /// it won the trial, or both ways during it.
    fn compress(&mut self, payload: &[u8]) {
        let Some(gpu) = &mut self.gpu else {
            return self.compressor.compress(payload, &mut self.packed);
        };
        let result = if gpu.chosen {
            gpu.compress(payload, &mut self.packed)
        } else {
            let t = Instant::now();
            self.compressor.compress(payload, &mut self.packed);
            gpu.cpu_seconds += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut scratch = std::mem::take(&mut gpu.scratch);
            let r = gpu.compress(payload, &mut scratch);
            gpu.scratch = scratch;
            gpu.gpu_seconds += t.elapsed().as_secs_f64();
            gpu.trials += 1;
            if r.is_ok() && gpu.trials == TRIAL_FRAMES {
                let (cpu, g) = (gpu.cpu_seconds, gpu.gpu_seconds);
                let measured =
                    format!("measured over {TRIAL_FRAMES} frames: GPU {:.2} ms, CPU {:.2} ms", g * 1e3, cpu * 1e3);
                if g < cpu {
                    gpu.chosen = true;
                    self.decided = Some(("zstd on the GPU (nvCOMP)".into(), measured));
                } else {
                    self.decided = Some(("zstd on the CPU".into(), measured));
                    self.gpu = None;
                }
            }
            r.map(|_| ())
        };
        if let Err(e) = result {
            // The frame goes out as the CPU compresses it; the GPU is not
            // asked again.
            self.decided = Some(("zstd on the CPU".into(), format!("nvCOMP failed: {e}")));
            self.gpu = None;
            self.compressor.compress(payload, &mut self.packed);
        }
    }
}

/// Frames compressed both ways before the faster one is kept.
const TRIAL_FRAMES: u32 = 8;
/// nvCOMP's chunk: a frame of 256 pages is 64 chunks for its thread blocks.
const GPU_CHUNK: usize = 16 << 10;

/// nvCOMP's zstd over a frame: whole chunks on the GPU, the rest on the
/// CPU, each a zstd frame; back to back they are one zstd batch on the
/// wire (the destination decodes them with the CPU's zstd as before).
struct GpuZstd {
    batch: NvcompBatch,
    rest: BatchCompressor,
    rest_out: Vec<u8>,
    scratch: Vec<u8>,
    cpu_seconds: f64,
    gpu_seconds: f64,
    trials: u32,
    chosen: bool,
}

impl GpuZstd {
    fn open(level: i32) -> Result<GpuZstd, GpuError> {
        let chunks = crate::protocol::pages::RECORDS_PER_FRAME * (tsubame_codec::PAGE_SIZE + 64) / GPU_CHUNK + 1;
        let batch = NvcompBatch::open(&Nvcomp::load()?, NvcompAlgo::Zstd, 0, chunks, GPU_CHUNK)?;
        Ok(GpuZstd {
            batch,
            rest: BatchCompressor::new(BatchCodec::Zstd(level)),
            rest_out: Vec::new(),
            scratch: Vec::new(),
            cpu_seconds: 0.0,
            gpu_seconds: 0.0,
            trials: 0,
            chosen: false,
        })
    }

    fn compress(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Result<(), GpuError> {
        let whole = payload.len() / GPU_CHUNK * GPU_CHUNK;
        out.clear();
        if whole > 0 {
            out.extend_from_slice(&self.batch.compress(&payload[..whole])?.data);
        }
        if whole < payload.len() {
            self.rest.compress(&payload[whole..], &mut self.rest_out);
            out.extend_from_slice(&self.rest_out);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_frames_are_compressed_on_the_cpu_and_the_choice_says_why() {
        if tsubame_gpu::cuda::driver_present() {
            return; // about a machine without one: gpu_check.sh's replays cover a GPU
        }
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 97) as u8).collect();
        for (codec, chose) in [(BatchCodec::Zstd(1), "zstd on the CPU"), (BatchCodec::Lz4, "lz4 on the CPU")] {
            let mut packer = FramePacker::with_gpu(codec);
            let (what, why) = packer.gpu_choice().expect("settled at once without a GPU").clone();
            assert_eq!(what, chose);
            assert!(why.contains("nvCOMP"), "{why}");
            let mut frame = Vec::new();
            assert!(packer.pack(0, &payload, f64::INFINITY, &mut frame));
            let (header, packed) = CompressedHeader::parse(&frame).unwrap();
            let mut back = Vec::new();
            tsubame_codec::batch::decompress(header.compressor, packed, payload.len(), 1 << 20, &mut back).unwrap();
            assert!(back == payload);
        }
    }
}

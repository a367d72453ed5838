//! Errors of the GPU backend.

use tsubame_codec::CodecError;

/// What went wrong on the way to, or on, the GPU.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver found (libcuda.so.1 did not load)")]
    NoDriver,
    /// The driver loaded but reports no usable device.
    #[error("no CUDA device found")]
    NoDevice,
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {code}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its result code.
        code: String,
    },
    /// This binary was built without the kernel emulator.
    #[error("the GPU kernel emulator was not built (no C++ compiler when tsubame was built): install g++ and rebuild")]
    NoEmulator,
    /// libnvrtc could not be loaded.
    #[error("no NVRTC library found (set TSUBAME_NVRTC to libnvrtc.so.12, or pip install nvidia-cuda-nvrtc-cu12)")]
    NoNvrtc,
    /// NVRTC rejected the kernels; the log says why.
    #[error("NVRTC could not compile the kernels: {log}")]
    Compile {
        /// NVRTC's log.
        log: String,
    },
    /// libnvcomp could not be loaded or lacks a function.
    #[error("nvCOMP unavailable: {0}")]
    NvcompMissing(String),
    /// An nvCOMP call failed.
    #[error("nvCOMP {call} failed with status {status} ({})", crate::nvcomp::status_name(*.status))]
    Nvcomp {
        /// The nvCOMP function.
        call: &'static str,
        /// Its nvcompStatus_t.
        status: i32,
    },
    /// An nvCOMP batched call reported a failure for one chunk.
    #[error("nvCOMP {call} failed on chunk {chunk} with status {status} ({})", crate::nvcomp::status_name(*.status))]
    NvcompChunk {
        /// The nvCOMP function.
        call: &'static str,
        /// The chunk's index in the input.
        chunk: usize,
        /// Its device status (nvcompStatus_t).
        status: i32,
    },
    /// An nvCOMP batched call gave a chunk a size it cannot have.
    #[error("nvCOMP {call} gave chunk {chunk} a size of {bytes} bytes (expected {expected})")]
    NvcompChunkSize {
        /// The nvCOMP function.
        call: &'static str,
        /// The chunk's index in the input.
        chunk: usize,
        /// The size it reported.
        bytes: usize,
        /// What it should be.
        expected: String,
    },
    /// The emulator does not know a kernel (a bug).
    #[error("kernel {0} is unknown")]
    UnknownKernel(&'static str),
    /// A batch the backend cannot take.
    #[error("bad batch: {0}")]
    BadBatch(String),
    /// A record the decoder rejected.
    #[error(transparent)]
    Codec(#[from] CodecError),
}

//! GPU offload of tsubame's page codecs (GMigrate's design on CUDA).
//!
//! The kernels are CUDA C (`kernels/*.cu`), compiled at run time by NVRTC
//! and launched through the driver API, both loaded with `dlopen`: the
//! same binary runs where there is no GPU and says "no CUDA driver found"
//! when asked for one. Their output is byte-identical to the CPU codecs of
//! `tsubame-codec` (same wire format, same cache rules), so a GPU sender
//! talks to a CPU receiver and the reverse.
//!
//! - [`GpuEncoder`] / [`GpuDecoder`]: batches of pages ↔ records, on a
//!   [`Backend`]: [`Cuda`] (a GPU) or [`Emulator`] (the same kernels run on
//!   the host, for tests).
//! - [`WaitPolicy`]: spin, GMigrate's sleep-for-the-shortest-sample, or
//!   CUDA blocking-sync events.
//! - [`nvcomp`]: nvCOMP's batched LZ4/zstd through `libnvcomp`, as the
//!   well-kept GPU baseline.
//!
//! `docs/gpu.md` has the design and what is still to be verified on a GPU.

#![deny(missing_docs)]

pub mod backend;
pub mod cuda;
mod driver;
pub mod emu;
mod encoder;
mod error;
mod geometry;
pub mod kernels;
pub mod nvcomp;
pub mod nvrtc;
pub mod profile;
pub mod wait;

pub use backend::Backend;
pub use cuda::{Cuda, CudaOptions};
pub use emu::Emulator;
pub use encoder::{EncodedBatch, GpuDecoder, GpuEncoder, DEFAULT_BATCH_PAGES};
pub use error::GpuError;
pub use geometry::{dedup_sets, split_unique, xbzrle_sets};
pub use profile::Profile;
pub use wait::WaitPolicy;

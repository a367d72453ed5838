//! nvCOMP's batched LZ4 and zstd (the well-kept GPU baseline), loaded at
//! run time from `libnvcomp.so` (`$TSUBAME_NVCOMP`, the loader's path, or
//! the PyPI wheels `nvidia-libnvcomp-cu12`/`-cu13` under site-packages).
//!
//! [`Nvcomp::load`] needs no GPU: it loads the library, lists which of
//! [`SYMBOLS`] it has and asks its version. [`NvcompBatch`] runs nvCOMP's
//! batched model on a GPU: pages in, one chunk per page, compressed chunks
//! out ([`Compressed`]), and back. nvCOMP 6's C API only (`API_MAJOR`):
//! older releases export the same names with other parameters.
//!
//! Written against the nvCOMP 6.0.0.12 headers and checked here for
//! loading, symbols and the host-only calls (alignments, output bounds);
//! the device calls are unverified until run on a GPU (docs/gpu.md).

mod batch;
mod compressed;
mod ffi;
mod library;

pub use batch::{NvcompBatch, MAX_CHUNK_BYTES};
pub use compressed::Compressed;
pub use ffi::{status_name, AlignmentRequirements};
pub use library::{candidates, Nvcomp, NvcompAlgo, API_MAJOR, SYMBOLS};

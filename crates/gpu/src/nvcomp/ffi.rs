//! nvCOMP 6's C types and function signatures for batched LZ4 and zstd,
//! mirrored by hand from `nvcomp/shared_types.h`, `nvcomp/lz4.h`,
//! `nvcomp/zstd.h` and `nvcomp.h` (nvCOMP 6.0.0.12).
//!
//! The options structs are passed *by value* (64 bytes each: larger than
//! 16 bytes, so the x86-64 SysV ABI passes them in memory, which
//! `#[repr(C)]` by value reproduces). Every field of every options struct
//! is zero in nvCOMP's defaults (`nvcompBatched*DefaultOpts`), so
//! `Default` (all zeros) is exactly those defaults.

use std::ffi::{c_char, c_int, c_void};

use cudarc::driver::sys::CUstream;

/// `nvcompStatus_t`: a C enum, an `int`.
pub type Status = c_int;

/// `nvcompSuccess`.
pub const SUCCESS: Status = 0;

/// The name of an `nvcompStatus_t` value, as in `shared_types.h`.
pub fn status_name(status: i32) -> &'static str {
    match status {
        0 => "nvcompSuccess",
        10 => "nvcompErrorInvalidValue",
        11 => "nvcompErrorNotSupported",
        12 => "nvcompErrorCannotDecompress",
        13 => "nvcompErrorBadChecksum",
        14 => "nvcompErrorCannotVerifyChecksums",
        15 => "nvcompErrorOutputBufferTooSmall",
        16 => "nvcompErrorWrongHeaderLength",
        17 => "nvcompErrorAlignment",
        18 => "nvcompErrorChunkSizeTooLarge",
        19 => "nvcompErrorCannotCompress",
        20 => "nvcompErrorWrongInputLength",
        21 => "nvcompErrorBatchSizeTooLarge",
        22 => "nvcompErrorSubChunkCountTooLarge",
        23 => "nvcompErrorSubChunkCountTooSmall",
        24 => "nvcompErrorOutputBufferAlignmentTooSmall",
        1000 => "nvcompErrorCudaError",
        10000 => "nvcompErrorInternal",
        _ => "unknown nvcompStatus_t",
    }
}

/// `nvcompAlignmentRequirements_t`: the minimum alignment, in bytes, of
/// each input chunk, each output chunk and the temporary buffer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AlignmentRequirements {
    /// Of each input chunk.
    pub input: usize,
    /// Of each output chunk.
    pub output: usize,
    /// Of the temporary buffer (1 when none is used).
    pub temp: usize,
}

impl AlignmentRequirements {
    /// The largest of the three.
    pub fn max(&self) -> usize {
        self.input.max(self.output).max(self.temp)
    }
}

/// `nvcompProperties_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Properties {
    /// nvCOMP's version, major * 1000 + minor * 100 + patch.
    pub version: u32,
    /// The CUDA runtime it was built with (major * 1000 + minor * 10).
    pub cudart_version: u32,
}

/// `nvcompBatchedLZ4CompressOpts_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Lz4CompressOpts {
    /// `nvcompType_t data_type` (`NVCOMP_TYPE_CHAR` = 0).
    pub data_type: c_int,
    /// `nvcompBitshuffleMode_t bitshuffle_mode` (`NVCOMP_BITSHUFFLE_NONE` = 0).
    pub bitshuffle_mode: c_int,
    /// `char reserved[56]`, zero.
    pub reserved: [c_char; 56],
}

/// `nvcompBatchedLZ4DecompressOpts_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Lz4DecompressOpts {
    /// `nvcompDecompressBackend_t backend` (`NVCOMP_DECOMPRESS_BACKEND_DEFAULT` = 0).
    pub backend: c_int,
    /// `int sort_before_hw_decompress`.
    pub sort_before_hw_decompress: c_int,
    /// `nvcompType_t data_type` (`NVCOMP_TYPE_CHAR` = 0).
    pub data_type: c_int,
    /// `nvcompBitshuffleMode_t bitshuffle_mode` (`NVCOMP_BITSHUFFLE_NONE` = 0).
    pub bitshuffle_mode: c_int,
    /// `char reserved[48]`, zero.
    pub reserved: [c_char; 48],
}

/// `nvcompBatchedZstdCompressOpts_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ZstdCompressOpts {
    /// `char reserved[64]`, zero.
    pub reserved: [c_char; 64],
}

/// `nvcompBatchedZstdDecompressOpts_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ZstdDecompressOpts {
    /// `nvcompDecompressBackend_t backend` (`NVCOMP_DECOMPRESS_BACKEND_DEFAULT` = 0).
    pub backend: c_int,
    /// `char reserved[60]`, zero.
    pub reserved: [c_char; 60],
}

impl Default for Lz4CompressOpts {
    fn default() -> Self {
        Lz4CompressOpts { data_type: 0, bitshuffle_mode: 0, reserved: [0; 56] }
    }
}

impl Default for Lz4DecompressOpts {
    fn default() -> Self {
        Lz4DecompressOpts {
            backend: 0,
            sort_before_hw_decompress: 0,
            data_type: 0,
            bitshuffle_mode: 0,
            reserved: [0; 48],
        }
    }
}

impl Default for ZstdCompressOpts {
    fn default() -> Self {
        ZstdCompressOpts { reserved: [0; 64] }
    }
}

impl Default for ZstdDecompressOpts {
    fn default() -> Self {
        ZstdDecompressOpts { backend: 0, reserved: [0; 60] }
    }
}

// The headers' layouts: 64 bytes each (checked with the C compiler against
// the 6.0.0.12 headers), `nvcompAlignmentRequirements_t` three size_t.
const _: () = {
    assert!(std::mem::size_of::<Lz4CompressOpts>() == 64 && std::mem::align_of::<Lz4CompressOpts>() == 4);
    assert!(std::mem::size_of::<Lz4DecompressOpts>() == 64 && std::mem::align_of::<Lz4DecompressOpts>() == 4);
    assert!(std::mem::size_of::<ZstdCompressOpts>() == 64 && std::mem::align_of::<ZstdCompressOpts>() == 1);
    assert!(std::mem::size_of::<ZstdDecompressOpts>() == 64 && std::mem::align_of::<ZstdDecompressOpts>() == 4);
    assert!(std::mem::size_of::<AlignmentRequirements>() == 24);
    assert!(std::mem::size_of::<Properties>() == 8);
};

/// `nvcompStatus_t nvcompGetProperties(nvcompProperties_t*)`.
pub type PropertiesFn = unsafe extern "C" fn(*mut Properties) -> Status;

/// `nvcompBatched{LZ4,Zstd}{Compress,Decompress}GetRequiredAlignments(opts,
/// nvcompAlignmentRequirements_t*)`.
pub type AlignFn<O> = unsafe extern "C" fn(O, *mut AlignmentRequirements) -> Status;

/// `nvcompBatched{LZ4,Zstd}{Compress,Decompress}GetTempSize(size_t
/// num_chunks, size_t max_uncompressed_chunk_bytes, opts, size_t*
/// temp_bytes, size_t max_total_uncompressed_bytes, cudaStream_t)`.
pub type TempSizeFn<O> = unsafe extern "C" fn(usize, usize, O, *mut usize, usize, CUstream) -> Status;

/// `nvcompBatched{LZ4,Zstd}CompressGetMaxOutputChunkSize(size_t
/// max_uncompressed_chunk_bytes, opts, size_t* max_compressed_chunk_bytes)`.
pub type MaxOutputFn<O> = unsafe extern "C" fn(usize, O, *mut usize) -> Status;

/// `nvcompBatched{LZ4,Zstd}CompressAsync(const void* const*
/// device_uncompressed_chunk_ptrs, const size_t*
/// device_uncompressed_chunk_bytes, size_t max_uncompressed_chunk_bytes,
/// size_t num_chunks, void* device_temp_ptr, size_t temp_bytes, void*
/// const* device_compressed_chunk_ptrs, size_t*
/// device_compressed_chunk_bytes, opts, nvcompStatus_t* device_statuses,
/// cudaStream_t)`.
pub type CompressFn<O> = unsafe extern "C" fn(
    *const *const c_void,
    *const usize,
    usize,
    usize,
    *mut c_void,
    usize,
    *const *mut c_void,
    *mut usize,
    O,
    *mut Status,
    CUstream,
) -> Status;

/// `nvcompBatched{LZ4,Zstd}DecompressAsync(const void* const*
/// device_compressed_chunk_ptrs, const size_t*
/// device_compressed_chunk_bytes, const size_t*
/// device_uncompressed_buffer_bytes, size_t*
/// device_uncompressed_chunk_bytes, size_t num_chunks, void* const
/// device_temp_ptr, size_t temp_bytes, void* const*
/// device_uncompressed_chunk_ptrs, opts, nvcompStatus_t* device_statuses,
/// cudaStream_t)`.
pub type DecompressFn<O> = unsafe extern "C" fn(
    *const *const c_void,
    *const usize,
    *const usize,
    *mut usize,
    usize,
    *mut c_void,
    usize,
    *const *mut c_void,
    O,
    *mut Status,
    CUstream,
) -> Status;

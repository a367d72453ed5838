//! nvCOMP's batched model on one GPU: fixed-size chunks (a 4 KiB page
//! each) compressed and decompressed in batches, with the device buffers,
//! pinned staging and stream that takes.
//!
//! Device layout (every buffer from `cuMemAlloc`, so 256-byte aligned):
//! the uncompressed chunks at a stride of `chunk_bytes` rounded up to the
//! alignment, the compressed slots at a stride of nvCOMP's bound on a
//! compressed chunk rounded up likewise, and the pointer, size and status
//! arrays. The alignment is the largest of nvCOMP's requirements for the
//! codec (`Get*RequiredAlignments`) and 32 bytes (the header's advice for
//! speed); the constructor refuses one over 256.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::compressed::Compressed;
use super::library::{Api, Launch, Nvcomp, NvcompAlgo};
use crate::driver::check;
use crate::driver::driver_present;
use crate::GpuError;

/// Chunk slots are aligned to at least this.
const MIN_ALIGN: usize = 32;
/// What `cuMemAlloc` guarantees.
const ALLOC_ALIGN: usize = 256;
/// The largest chunk both codecs compress (`nvcompLZ4CompressionMaxAllowedChunkSize`;
/// zstd's compress documents 16 MB too).
pub const MAX_CHUNK_BYTES: usize = 1 << 24;

/// Device buffers (`CUdeviceptr`s).
#[derive(Default)]
struct Device {
    /// Uncompressed chunks, `in_stride` apart.
    input: sys::CUdeviceptr,
    /// Compressed chunks: slots `out_stride` apart after compression,
    /// packed at aligned offsets before decompression.
    output: sys::CUdeviceptr,
    /// `void*[max_chunks]`: `input + i * in_stride`.
    input_ptrs: sys::CUdeviceptr,
    /// `void*[max_chunks]`: `output + i * out_stride`.
    output_ptrs: sys::CUdeviceptr,
    /// `void*[max_chunks]`: the packed compressed chunks.
    packed_ptrs: sys::CUdeviceptr,
    /// `size_t[max_chunks]`, all `chunk_bytes`.
    chunk_sizes: sys::CUdeviceptr,
    /// `size_t[max_chunks]`: compressed sizes.
    comp_sizes: sys::CUdeviceptr,
    /// `size_t[max_chunks]`: decompressed sizes.
    actual_sizes: sys::CUdeviceptr,
    /// `nvcompStatus_t[max_chunks]`.
    statuses: sys::CUdeviceptr,
    /// nvCOMP's temporary buffer.
    temp: sys::CUdeviceptr,
}

/// Pinned host staging, the same sizes as the device's.
struct Host {
    input: *mut u8,
    output: *mut u8,
    comp_sizes: *mut usize,
    actual_sizes: *mut usize,
    statuses: *mut i32,
    ptrs: *mut u64,
}

impl Default for Host {
    fn default() -> Self {
        use std::ptr::null_mut;
        Host {
            input: null_mut(),
            output: null_mut(),
            comp_sizes: null_mut(),
            actual_sizes: null_mut(),
            statuses: null_mut(),
            ptrs: null_mut(),
        }
    }
}

/// nvCOMP's batched LZ4 or zstd on one GPU, for chunks of `chunk_bytes`,
/// up to `max_chunks` per call to nvCOMP (longer inputs are split).
pub struct NvcompBatch {
    api: Api,
    algo: NvcompAlgo,
    name: String,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    max_chunks: usize,
    chunk_bytes: usize,
    max_out: usize,
    align: usize,
    in_stride: usize,
    out_stride: usize,
    temp_bytes: usize,
    d: Device,
    h: Host,
    device_allocs: Vec<sys::CUdeviceptr>,
    host_allocs: Vec<*mut c_void>,
}

// SAFETY: the CUDA handles and pinned buffers are used by one thread at a
// time (`&mut self`), and every call makes the context current on the
// calling thread first.
unsafe impl Send for NvcompBatch {}

impl NvcompBatch {
    /// Opens `algo` on device `device` for batches of up to `max_chunks`
    /// chunks of `chunk_bytes` (4096: one page per chunk). Needs nvCOMP 6
    /// (`NvcompMissing` otherwise) and a driver (`NoDriver`, never a panic,
    /// without libcuda).
    pub fn open(
        nvcomp: &Nvcomp,
        algo: NvcompAlgo,
        device: i32,
        max_chunks: usize,
        chunk_bytes: usize,
    ) -> Result<NvcompBatch, GpuError> {
        let api = nvcomp.api(algo)?;
        if max_chunks == 0 || chunk_bytes == 0 || chunk_bytes > MAX_CHUNK_BYTES {
            return Err(GpuError::BadBatch(format!(
                "nvCOMP batches need 1 or more chunks of 1 to {MAX_CHUNK_BYTES} bytes (asked {max_chunks} of {chunk_bytes})"
            )));
        }
        let (c, d) = api.alignments()?;
        let align = c.max().max(d.max()).max(MIN_ALIGN);
        if !align.is_power_of_two() || align > ALLOC_ALIGN {
            return Err(GpuError::BadBatch(format!(
                "nvCOMP {algo} asks for {align}-byte alignment; cuMemAlloc gives {ALLOC_ALIGN}"
            )));
        }
        let max_out = api.max_compressed_chunk_bytes(chunk_bytes)?;
        if max_out == 0 {
            return Err(GpuError::BadBatch(format!("nvCOMP {algo} gives 0 as its bound on a compressed chunk")));
        }
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        let mut b = NvcompBatch {
            api,
            algo,
            name: String::new(),
            ctx: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            max_chunks,
            chunk_bytes,
            max_out,
            align,
            in_stride: chunk_bytes.next_multiple_of(align),
            out_stride: max_out.next_multiple_of(align),
            temp_bytes: 0,
            d: Device::default(),
            h: Host::default(),
            device_allocs: Vec::new(),
            host_allocs: Vec::new(),
        };
        b.init(device)?;
        Ok(b)
    }

    /// The context, stream and buffers; on error, `Drop` frees what was
    /// made.
    fn init(&mut self, device: i32) -> Result<(), GpuError> {
        let n = self.max_chunks;
        // SAFETY: libcuda is present (checked by the caller), so cudarc's
        // loader does not panic; every out-pointer is a valid local or
        // field.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
            if device < 0 || count <= device {
                return Err(GpuError::NoDevice);
            }
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, device))?;
            // The primary context: the one nvCOMP's (static) CUDA runtime
            // uses, so its work and ours share it.
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut self.ctx, dev))?;
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctx))?;
            let mut name = [0 as std::ffi::c_char; 128];
            check("cuDeviceGetName", sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev))?;
            self.name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            check("cuStreamCreate", sys::cuStreamCreate(&mut self.stream, 1))?; // CU_STREAM_NON_BLOCKING
        }
        self.d.input = self.alloc(n * self.in_stride)?;
        self.d.output = self.alloc(n * self.out_stride)?;
        self.d.input_ptrs = self.alloc(n * 8)?;
        self.d.output_ptrs = self.alloc(n * 8)?;
        self.d.packed_ptrs = self.alloc(n * 8)?;
        self.d.chunk_sizes = self.alloc(n * 8)?;
        self.d.comp_sizes = self.alloc(n * 8)?;
        self.d.actual_sizes = self.alloc(n * 8)?;
        self.d.statuses = self.alloc(n * 4)?;
        self.h.input = self.alloc_host(n * self.in_stride)?.cast();
        self.h.output = self.alloc_host(n * self.out_stride)?.cast();
        self.h.comp_sizes = self.alloc_host(n * 8)?.cast();
        self.h.actual_sizes = self.alloc_host(n * 8)?.cast();
        self.h.statuses = self.alloc_host(n * 4)?.cast();
        self.h.ptrs = self.alloc_host(n * 8)?.cast();
        // SAFETY: the stream is live in the current context.
        let (c, d) = unsafe {
            (
                self.api.temp_bytes(true, n, self.chunk_bytes, self.stream)?,
                self.api.temp_bytes(false, n, self.chunk_bytes, self.stream)?,
            )
        };
        self.ensure_temp(c.max(d))?;
        // The arrays that never change, from vectors that outlive the
        // copies (the stream is synchronized below).
        let input_ptrs: Vec<u64> = (0..n).map(|i| self.d.input + (i * self.in_stride) as u64).collect();
        let output_ptrs: Vec<u64> = (0..n).map(|i| self.d.output + (i * self.out_stride) as u64).collect();
        let sizes: Vec<usize> = vec![self.chunk_bytes; n];
        // SAFETY: each source holds exactly the bytes copied and lives
        // until the synchronization; each destination has `n * 8` bytes.
        unsafe {
            self.upload(self.d.input_ptrs, input_ptrs.as_ptr().cast(), n * 8)?;
            self.upload(self.d.output_ptrs, output_ptrs.as_ptr().cast(), n * 8)?;
            self.upload(self.d.chunk_sizes, sizes.as_ptr().cast(), n * 8)?;
        }
        self.sync()
    }

    /// The codec.
    pub fn algo(&self) -> NvcompAlgo {
        self.algo
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The most chunks per nvCOMP call.
    pub fn max_chunks(&self) -> usize {
        self.max_chunks
    }

    /// The uncompressed size of a chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// nvCOMP's bound on one compressed chunk.
    pub fn max_compressed_chunk_bytes(&self) -> usize {
        self.max_out
    }

    /// Compresses `pages` (a multiple of `chunk_bytes`), one chunk at a
    /// time as nvCOMP sees it, in calls of up to `max_chunks`; the host
    /// copies both ways are included. Every chunk's device status and size
    /// is checked.
    pub fn compress(&mut self, pages: &[u8]) -> Result<Compressed, GpuError> {
        self.whole_chunks(pages)?;
        self.make_current()?;
        let r = self.compress_groups(pages);
        self.drain_on_error(r)
    }

    fn compress_groups(&mut self, pages: &[u8]) -> Result<Compressed, GpuError> {
        let mut out = Compressed::new(self.algo, self.chunk_bytes);
        out.data.reserve(pages.len() / 2);
        for (g, group) in pages.chunks(self.max_chunks * self.chunk_bytes).enumerate() {
            let n = group.len() / self.chunk_bytes;
            self.stage_async(group)?;
            self.launch_compress(n)?;
            // SAFETY: the pinned buffers hold `max_chunks` entries and the
            // device arrays as many; nothing reads them until `sync`.
            unsafe {
                self.download(self.h.comp_sizes.cast(), self.d.comp_sizes, n * 8)?;
                self.download(self.h.statuses.cast(), self.d.statuses, n * 4)?;
                self.download(self.h.output, self.d.output, n * self.out_stride)?;
            }
            self.sync()?;
            let call = self.api.call_name(true);
            let base = g * self.max_chunks;
            // SAFETY: the copies into these pinned arrays completed in
            // `sync`; each holds at least `n` entries.
            let (statuses, sizes) = unsafe {
                (std::slice::from_raw_parts(self.h.statuses, n), std::slice::from_raw_parts(self.h.comp_sizes, n))
            };
            for i in 0..n {
                if statuses[i] != 0 {
                    return Err(GpuError::NvcompChunk { call, chunk: base + i, status: statuses[i] });
                }
                if sizes[i] == 0 || sizes[i] > self.max_out {
                    let expected = format!("1 to {}", self.max_out);
                    return Err(GpuError::NvcompChunkSize { call, chunk: base + i, bytes: sizes[i], expected });
                }
                // SAFETY: slot `i` of the pinned output buffer (`out_stride`
                // ≥ `max_out` ≥ `sizes[i]` bytes), filled by the completed
                // copy.
                out.push(unsafe { std::slice::from_raw_parts(self.h.output.add(i * self.out_stride), sizes[i]) });
            }
        }
        Ok(out)
    }

    /// Decompresses what [`NvcompBatch::compress`] (of the same codec and
    /// chunk size) made, checking every chunk's status and that each
    /// decodes to exactly `chunk_bytes`. nvCOMP's zstd does not promise to
    /// detect corrupt input (its header: undefined behavior on the
    /// device), so only pass chunks a compressor made.
    pub fn decompress(&mut self, c: &Compressed) -> Result<Vec<u8>, GpuError> {
        if c.algo != self.algo || c.chunk_bytes != self.chunk_bytes {
            return Err(GpuError::BadBatch(format!(
                "{} chunks of {} bytes given to nvCOMP {} of {}-byte chunks",
                c.algo, c.chunk_bytes, self.algo, self.chunk_bytes
            )));
        }
        c.check_offsets()?;
        self.make_current()?;
        let r = self.decompress_groups(c);
        self.drain_on_error(r)
    }

    fn decompress_groups(&mut self, c: &Compressed) -> Result<Vec<u8>, GpuError> {
        let mut out = Vec::with_capacity(c.uncompressed_bytes());
        for base in (0..c.len()).step_by(self.max_chunks) {
            let n = self.max_chunks.min(c.len() - base);
            let mut at = 0;
            for i in 0..n {
                let chunk = c.chunk(base + i);
                if chunk.is_empty() || chunk.len() > self.max_out {
                    return Err(GpuError::BadBatch(format!(
                        "compressed chunk {} has {} bytes; nvCOMP {} makes 1 to {}",
                        base + i,
                        chunk.len(),
                        self.algo,
                        self.max_out
                    )));
                }
                // SAFETY: `at + chunk.len() <= i * out_stride + out_stride`
                // (each earlier chunk took at most `out_stride`), inside
                // the pinned output buffer of `max_chunks * out_stride`;
                // entry `i` of the pinned arrays exists (`i < max_chunks`).
                // No copy reads these buffers now (the last call synced).
                unsafe {
                    std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.h.output.add(at), chunk.len());
                    *self.h.ptrs.add(i) = self.d.output + at as u64;
                    *self.h.comp_sizes.add(i) = chunk.len();
                }
                at += chunk.len().next_multiple_of(self.align);
            }
            // SAFETY: the pinned sources hold the bytes written above and
            // are not touched again before `sync`; the device buffers have
            // room (`at <= n * out_stride`, arrays of `max_chunks`).
            unsafe {
                self.upload(self.d.output, self.h.output.cast(), at)?;
                self.upload(self.d.packed_ptrs, self.h.ptrs.cast(), n * 8)?;
                self.upload(self.d.comp_sizes, self.h.comp_sizes.cast(), n * 8)?;
            }
            self.ensure_temp_for(false, n)?;
            let d = &self.d;
            let launch =
                self.launch_args(n, [d.packed_ptrs, d.comp_sizes], [d.input_ptrs, d.chunk_sizes, d.actual_sizes]);
            // SAFETY: every array of `launch` was allocated for
            // `max_chunks >= n` entries in this context; the packed chunks
            // are at `align`-aligned offsets of a 256-aligned buffer; the
            // output slots have `chunk_bytes` each at `in_stride`; the temp
            // buffer has `temp_bytes`, at least nvCOMP's size for `n`.
            unsafe { self.api.decompress(&launch)? };
            // SAFETY: the pinned destinations have room for `n` entries and
            // `n * in_stride` bytes; nothing reads them before `sync`.
            unsafe {
                self.download(self.h.input, self.d.input, n * self.in_stride)?;
                self.download(self.h.actual_sizes.cast(), self.d.actual_sizes, n * 8)?;
                self.download(self.h.statuses.cast(), self.d.statuses, n * 4)?;
            }
            self.sync()?;
            let call = self.api.call_name(false);
            // SAFETY: the copies completed in `sync`; `n` entries each.
            let (statuses, sizes) = unsafe {
                (std::slice::from_raw_parts(self.h.statuses, n), std::slice::from_raw_parts(self.h.actual_sizes, n))
            };
            for i in 0..n {
                if statuses[i] != 0 {
                    return Err(GpuError::NvcompChunk { call, chunk: base + i, status: statuses[i] });
                }
                if sizes[i] != self.chunk_bytes {
                    let expected = self.chunk_bytes.to_string();
                    return Err(GpuError::NvcompChunkSize { call, chunk: base + i, bytes: sizes[i], expected });
                }
                // SAFETY: slot `i` of the pinned input buffer, `chunk_bytes`
                // ≤ `in_stride` bytes, filled by the completed copy.
                out.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(self.h.input.add(i * self.in_stride), self.chunk_bytes)
                });
            }
        }
        Ok(out)
    }

    /// Copies `pages` (at most `max_chunks` chunks) to the device and
    /// waits, for [`NvcompBatch::compress_staged`]; returns the number of
    /// chunks.
    pub fn stage(&mut self, pages: &[u8]) -> Result<usize, GpuError> {
        let n = self.whole_chunks(pages)?;
        if n > self.max_chunks {
            return Err(GpuError::BadBatch(format!("{n} chunks staged, more than {}", self.max_chunks)));
        }
        self.make_current()?;
        let r = self.stage_async(pages).and_then(|_| self.sync());
        self.drain_on_error(r.map(|_| n))
    }

    /// Compresses the first `chunks` staged chunks on the device and waits
    /// for it: the device-only part of [`NvcompBatch::compress`], for
    /// timing. The output stays on the device, unchecked.
    pub fn compress_staged(&mut self, chunks: usize) -> Result<(), GpuError> {
        if chunks > self.max_chunks {
            return Err(GpuError::BadBatch(format!("{chunks} chunks, more than {}", self.max_chunks)));
        }
        self.make_current()?;
        let r = self.launch_compress(chunks).and_then(|_| self.sync());
        self.drain_on_error(r)
    }

    /// After a failed call, waits for what it queued, so that the next
    /// call does not rewrite pinned staging a queued copy still reads.
    fn drain_on_error<T>(&self, r: Result<T, GpuError>) -> Result<T, GpuError> {
        if r.is_err() {
            let _ = self.sync();
        }
        r
    }

    fn whole_chunks(&self, pages: &[u8]) -> Result<usize, GpuError> {
        if !pages.len().is_multiple_of(self.chunk_bytes) {
            return Err(GpuError::BadBatch(format!(
                "{} bytes is not a whole number of {}-byte chunks",
                pages.len(),
                self.chunk_bytes
            )));
        }
        Ok(pages.len() / self.chunk_bytes)
    }

    /// Queues the copy of `group` (≤ `max_chunks` chunks) into the input
    /// slots.
    fn stage_async(&mut self, group: &[u8]) -> Result<(), GpuError> {
        let n = group.len() / self.chunk_bytes;
        debug_assert!(n <= self.max_chunks);
        // SAFETY: the pinned input buffer has `max_chunks * in_stride`
        // bytes and `group` fits (n ≤ max_chunks); no copy reads it now
        // (every call ends with `sync`).
        unsafe {
            if self.in_stride == self.chunk_bytes {
                std::ptr::copy_nonoverlapping(group.as_ptr(), self.h.input, group.len());
            } else {
                for (i, chunk) in group.chunks_exact(self.chunk_bytes).enumerate() {
                    std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.h.input.add(i * self.in_stride), chunk.len());
                }
            }
            self.upload(self.d.input, self.h.input.cast(), n * self.in_stride)
        }
    }

    /// Queues the compression of the first `n` input slots.
    fn launch_compress(&mut self, n: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        self.ensure_temp_for(true, n)?;
        let d = &self.d;
        let launch = self.launch_args(n, [d.input_ptrs, d.chunk_sizes], [d.output_ptrs, 0, d.comp_sizes]);
        // SAFETY: every array was allocated for `max_chunks >= n` entries
        // in this context; the input slots hold `chunk_bytes` each at
        // `in_stride`, the output slots `max_out` each at `out_stride`,
        // both multiples of nvCOMP's alignment from 256-aligned bases; the
        // temp buffer has `temp_bytes`, at least nvCOMP's size for `n`.
        unsafe { self.api.compress(&launch) }
    }

    /// A call over the first `n` slots: `src` is (pointers, sizes), `dst`
    /// is (pointers, capacities or 0 when compressing, sizes written).
    fn launch_args(&self, n: usize, src: [sys::CUdeviceptr; 2], dst: [sys::CUdeviceptr; 3]) -> Launch {
        Launch {
            src_ptrs: src[0],
            src_bytes: src[1],
            dst_ptrs: dst[0],
            dst_capacity: dst[1],
            dst_bytes: dst[2],
            statuses: self.d.statuses,
            temp: self.d.temp,
            temp_bytes: self.temp_bytes,
            chunks: n,
            chunk_bytes: self.chunk_bytes,
            stream: self.stream,
        }
    }

    /// Makes the temp buffer at least what nvCOMP asks for `n` chunks.
    fn ensure_temp_for(&mut self, compress: bool, n: usize) -> Result<(), GpuError> {
        // SAFETY: the stream is live in the current context.
        let need = unsafe { self.api.temp_bytes(compress, n, self.chunk_bytes, self.stream)? };
        self.ensure_temp(need)
    }

    fn ensure_temp(&mut self, need: usize) -> Result<(), GpuError> {
        if need <= self.temp_bytes && self.d.temp != 0 {
            return Ok(());
        }
        if self.d.temp != 0 {
            self.sync()?;
            self.device_allocs.retain(|&p| p != self.d.temp);
            // SAFETY: an allocation of ours no queued work uses any more
            // (synchronized above), freed once (removed from the list).
            unsafe { sys::cuMemFree_v2(self.d.temp) };
        }
        self.d.temp = self.alloc(need.max(1))?;
        self.temp_bytes = need.max(1);
        Ok(())
    }

    fn alloc(&mut self, bytes: usize) -> Result<sys::CUdeviceptr, GpuError> {
        let mut p = 0;
        // SAFETY: `p` is a valid out-pointer; the context is current.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(1)) })?;
        self.device_allocs.push(p);
        Ok(p)
    }

    fn alloc_host(&mut self, bytes: usize) -> Result<*mut c_void, GpuError> {
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; the context is current.
        check("cuMemAllocHost", unsafe { sys::cuMemAllocHost_v2(&mut p, bytes.max(1)) })?;
        self.host_allocs.push(p);
        Ok(p)
    }

    /// # Safety
    /// `src` holds `bytes` bytes that stay unchanged until the next `sync`;
    /// `dst` has room for them.
    unsafe fn upload(&self, dst: sys::CUdeviceptr, src: *const c_void, bytes: usize) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract; the stream is live.
        check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, self.stream) })
    }

    /// # Safety
    /// `dst` has room for `bytes` and is not read until the next `sync`;
    /// `src` holds them.
    unsafe fn download(&self, dst: *mut u8, src: sys::CUdeviceptr, bytes: usize) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract; the stream is live.
        check("cuMemcpyDtoHAsync", unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, self.stream) })
    }

    fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: the primary context retained in `init`.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    fn sync(&self) -> Result<(), GpuError> {
        // SAFETY: a live stream of the current context.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.stream) })
    }
}

impl Drop for NvcompBatch {
    /// Frees every buffer and the stream. The primary context stays
    /// retained (as [`crate::Cuda`] leaves it): nvCOMP's CUDA runtime keeps
    /// using it, and releasing the last reference would destroy it under
    /// the runtime.
    fn drop(&mut self) {
        if self.ctx.is_null() {
            return;
        }
        // SAFETY: every handle was made by this object in this context and
        // is released once; the stream is drained first so no queued copy
        // or kernel uses a buffer being freed; errors at teardown are
        // ignored.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx);
            if !self.stream.is_null() {
                sys::cuStreamSynchronize(self.stream);
            }
            for &p in &self.device_allocs {
                sys::cuMemFree_v2(p);
            }
            for &p in &self.host_allocs {
                sys::cuMemFreeHost(p);
            }
            if !self.stream.is_null() {
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

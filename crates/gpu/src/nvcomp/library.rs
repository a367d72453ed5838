//! Finding and loading libnvcomp, and its batched LZ4/zstd functions
//! resolved into typed pointers.

use std::ffi::c_void;
use std::path::PathBuf;

use cudarc::driver::sys;
use libloading::Library;

use super::ffi::{self, AlignFn, AlignmentRequirements, CompressFn, DecompressFn, MaxOutputFn, Status, TempSizeFn};
use crate::GpuError;

/// The nvCOMP C functions the batches call: `nvcompGetProperties`, then
/// seven for LZ4 and the same seven for zstd.
pub const SYMBOLS: [&str; 15] = [
    "nvcompGetProperties",
    "nvcompBatchedLZ4CompressGetRequiredAlignments",
    "nvcompBatchedLZ4DecompressGetRequiredAlignments",
    "nvcompBatchedLZ4CompressGetTempSize",
    "nvcompBatchedLZ4CompressGetMaxOutputChunkSize",
    "nvcompBatchedLZ4CompressAsync",
    "nvcompBatchedLZ4DecompressGetTempSize",
    "nvcompBatchedLZ4DecompressAsync",
    "nvcompBatchedZstdCompressGetRequiredAlignments",
    "nvcompBatchedZstdDecompressGetRequiredAlignments",
    "nvcompBatchedZstdCompressGetTempSize",
    "nvcompBatchedZstdCompressGetMaxOutputChunkSize",
    "nvcompBatchedZstdCompressAsync",
    "nvcompBatchedZstdDecompressGetTempSize",
    "nvcompBatchedZstdDecompressAsync",
];

/// The nvCOMP major version whose C API this module mirrors. nvCOMP 4 and
/// 5 export functions of the same names with other parameters (no
/// `device_statuses` before the stream, no stream in the temp-size calls),
/// so calling them through these signatures would be undefined behavior.
pub const API_MAJOR: u32 = 6;

/// Where libnvcomp is looked for, in order: `$TSUBAME_NVCOMP` (a file),
/// the loader's search path (`libnvcomp.so.6`, `libnvcomp.so`, `.so.5`,
/// `.so.4`), then the PyPI wheels' directories under every Python
/// site-packages (`nvidia/libnvcomp/lib64` of `nvidia-libnvcomp-cu12` and
/// `-cu13`, and older layouts).
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("TSUBAME_NVCOMP") {
        out.push(PathBuf::from(p));
    }
    for name in ["libnvcomp.so.6", "libnvcomp.so", "libnvcomp.so.5", "libnvcomp.so.4"] {
        out.push(name.into());
    }
    for root in crate::nvrtc::python_site_packages() {
        for sub in
            ["nvidia/libnvcomp/lib64", "nvidia/nvcomp", "nvidia/nvcomp/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"]
        {
            for name in ["libnvcomp.so.6", "libnvcomp.so.5", "libnvcomp.so.4", "libnvcomp.so"] {
                let p = root.join(sub).join(name);
                if p.exists() {
                    out.push(p);
                }
            }
        }
    }
    out
}

/// One of nvCOMP's batched codecs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NvcompAlgo {
    /// Batched LZ4: each chunk becomes a raw LZ4 block (no frame; the
    /// header does not say, `tests/gpu.rs` checks it with lz4_flex).
    Lz4,
    /// Batched zstd: each chunk becomes a standard zstd frame (checked
    /// likewise with libzstd).
    Zstd,
}

impl NvcompAlgo {
    /// Both, LZ4 first.
    pub const ALL: [NvcompAlgo; 2] = [NvcompAlgo::Lz4, NvcompAlgo::Zstd];

    /// This codec's seven functions in [`SYMBOLS`] (after
    /// `nvcompGetProperties`).
    fn symbols(self) -> &'static [&'static str] {
        match self {
            NvcompAlgo::Lz4 => &SYMBOLS[1..8],
            NvcompAlgo::Zstd => &SYMBOLS[8..15],
        }
    }
}

impl std::str::FromStr for NvcompAlgo {
    type Err = String;

    /// `lz4` or `zstd`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lz4" => Ok(NvcompAlgo::Lz4),
            "zstd" => Ok(NvcompAlgo::Zstd),
            _ => Err(format!("unknown nvCOMP codec '{s}' (known: lz4, zstd)")),
        }
    }
}

impl std::fmt::Display for NvcompAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NvcompAlgo::Lz4 => "lz4",
            NvcompAlgo::Zstd => "zstd",
        })
    }
}

/// A loaded libnvcomp. Loading needs no GPU and no driver. The library
/// chosen is never unloaded: it holds a CUDA runtime (linked statically)
/// whose state must outlive every batch, and its function pointers are
/// copied into them.
#[derive(Clone)]
pub struct Nvcomp {
    lib: &'static Library,
    /// The file it came from.
    pub path: PathBuf,
    /// Which of [`SYMBOLS`] it has.
    pub has: Vec<&'static str>,
    /// `nvcompGetProperties`' version (major * 1000 + minor * 100 +
    /// patch), when it has that function and it answered.
    pub version: Option<u32>,
}

impl std::fmt::Debug for Nvcomp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvcomp").field("path", &self.path).field("version", &self.version).finish()
    }
}

impl Nvcomp {
    /// Loads libnvcomp: `$TSUBAME_NVCOMP` when set and it loads, else the
    /// first of [`candidates`] that loads and is nvCOMP 6, else the first
    /// that loads (which [`crate::nvcomp::NvcompBatch::open`] then
    /// refuses, naming its version). `NvcompMissing` when none loads.
    pub fn load() -> Result<Nvcomp, GpuError> {
        let chosen = std::env::var_os("TSUBAME_NVCOMP").map(PathBuf::from);
        let mut fallback = None;
        for path in candidates() {
            if path.is_absolute() && !path.exists() {
                continue;
            }
            // SAFETY: loading libnvcomp runs its initializers (it links
            // the CUDA runtime statically, which does not touch the driver
            // until a CUDA call); no symbol is called here.
            let Ok(lib) = (unsafe { Library::new(&path) }) else { continue };
            let has = SYMBOLS
                .iter()
                .copied()
                // SAFETY: only the symbol's presence is checked; it is not
                // called.
                .filter(|s| unsafe { lib.get::<*const ()>(format!("{s}\0").as_bytes()) }.is_ok())
                .collect();
            let version = properties(&lib).map(|p| p.version);
            if version.is_some_and(|v| v / 1000 == API_MAJOR) || chosen.as_ref() == Some(&path) {
                return Ok(Nvcomp { lib: Box::leak(Box::new(lib)), path, has, version });
            }
            // Unloaded when not chosen: only nvcompGetProperties ran.
            fallback.get_or_insert((lib, path, has, version));
        }
        let found =
            fallback.map(|(lib, path, has, version)| Nvcomp { lib: Box::leak(Box::new(lib)), path, has, version });
        found.ok_or_else(|| {
            GpuError::NvcompMissing(
                "libnvcomp.so not found (set TSUBAME_NVCOMP, or pip install nvidia-libnvcomp-cu12 or -cu13)".into(),
            )
        })
    }

    /// The version as `6.0.0`, or `unknown`.
    pub fn version_string(&self) -> String {
        match self.version {
            Some(v) => format!("{}.{}.{}", v / 1000, v % 1000 / 100, v % 100),
            None => "unknown".into(),
        }
    }

    /// `algo`'s functions; `NvcompMissing` unless this is nvCOMP 6 with
    /// all of them.
    pub(crate) fn api(&self, algo: NvcompAlgo) -> Result<Api, GpuError> {
        if self.version.is_none_or(|v| v / 1000 != API_MAJOR) {
            return Err(GpuError::NvcompMissing(format!(
                "{} is nvCOMP {}; tsubame calls nvCOMP {API_MAJOR}'s C API (pip install nvidia-libnvcomp-cu13)",
                self.path.display(),
                self.version_string()
            )));
        }
        let n = algo.symbols();
        Ok(match algo {
            NvcompAlgo::Lz4 => Api::Lz4(Fns::resolve(self.lib, &self.path, n)?),
            NvcompAlgo::Zstd => Api::Zstd(Fns::resolve(self.lib, &self.path, n)?),
        })
    }

    /// The alignments nvCOMP requires of `algo`'s buffers: (compression,
    /// decompression). Host-only: needs no GPU.
    pub fn alignments(&self, algo: NvcompAlgo) -> Result<(AlignmentRequirements, AlignmentRequirements), GpuError> {
        self.api(algo)?.alignments()
    }

    /// The most bytes `algo` compresses a chunk of `chunk_bytes` into.
    /// Host-only: needs no GPU.
    pub fn max_compressed_chunk_bytes(&self, algo: NvcompAlgo, chunk_bytes: usize) -> Result<usize, GpuError> {
        self.api(algo)?.max_compressed_chunk_bytes(chunk_bytes)
    }
}

/// `nvcompGetProperties`, when present and successful.
fn properties(lib: &Library) -> Option<ffi::Properties> {
    // SAFETY: `nvcompGetProperties(nvcompProperties_t*)` has this signature
    // in every nvCOMP that exports it (nvcomp.h); the pointer is not kept
    // beyond this function, whose caller holds `lib`.
    let f = unsafe { lib.get::<ffi::PropertiesFn>(b"nvcompGetProperties\0") }.ok()?;
    let mut p = ffi::Properties::default();
    // SAFETY: `p` is a valid out-pointer to a `nvcompProperties_t`; the
    // function only fills it (no CUDA call: checked without a driver).
    (unsafe { f(&mut p) } == ffi::SUCCESS).then_some(p)
}

fn check(call: &'static str, status: Status) -> Result<(), GpuError> {
    if status == ffi::SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Nvcomp { call, status })
    }
}

/// One codec's functions, with its (default) options. The names index
/// [`SYMBOLS`] in this struct's field order.
pub(crate) struct Fns<C, D> {
    names: &'static [&'static str],
    c_opts: C,
    d_opts: D,
    c_align: AlignFn<C>,
    d_align: AlignFn<D>,
    c_temp: TempSizeFn<C>,
    c_max: MaxOutputFn<C>,
    compress: CompressFn<C>,
    d_temp: TempSizeFn<D>,
    decompress: DecompressFn<D>,
}

impl<C: Copy + Default, D: Copy + Default> Fns<C, D> {
    fn resolve(
        lib: &'static Library,
        path: &std::path::Path,
        names: &'static [&'static str],
    ) -> Result<Self, GpuError> {
        let missing = |i: usize| GpuError::NvcompMissing(format!("{} lacks {}", path.display(), names[i]));
        macro_rules! get {
            ($i:expr) => {
                // SAFETY: the type is the one nvCOMP 6's header declares for
                // this name (ffi.rs mirrors lz4.h/zstd.h; the version was
                // checked by the caller); `lib` is never unloaded.
                *unsafe { lib.get(format!("{}\0", names[$i]).as_bytes()) }.map_err(|_| missing($i))?
            };
        }
        Ok(Fns {
            names,
            c_opts: C::default(),
            d_opts: D::default(),
            c_align: get!(0),
            d_align: get!(1),
            c_temp: get!(2),
            c_max: get!(3),
            compress: get!(4),
            d_temp: get!(5),
            decompress: get!(6),
        })
    }

    fn alignments(&self) -> Result<(AlignmentRequirements, AlignmentRequirements), GpuError> {
        let (mut c, mut d) = (AlignmentRequirements::default(), AlignmentRequirements::default());
        // SAFETY: host-only functions; the opts are passed by value and the
        // out-pointers are valid locals.
        unsafe {
            check(self.names[0], (self.c_align)(self.c_opts, &mut c))?;
            check(self.names[1], (self.d_align)(self.d_opts, &mut d))?;
        }
        Ok((c, d))
    }

    fn max_compressed_chunk_bytes(&self, chunk_bytes: usize) -> Result<usize, GpuError> {
        let mut n = 0;
        // SAFETY: a host-only function; `n` is a valid out-pointer.
        check(self.names[3], unsafe { (self.c_max)(chunk_bytes, self.c_opts, &mut n) })?;
        Ok(n)
    }

    /// # Safety
    /// `stream` is null or a live stream of the current context.
    unsafe fn temp_bytes(
        &self,
        compress: bool,
        chunks: usize,
        chunk_bytes: usize,
        stream: sys::CUstream,
    ) -> Result<usize, GpuError> {
        let mut n = 0;
        let total = chunks * chunk_bytes;
        // SAFETY: `n` is a valid out-pointer; the stream is valid (the
        // caller's contract); the functions enqueue nothing.
        unsafe {
            if compress {
                check(self.names[2], (self.c_temp)(chunks, chunk_bytes, self.c_opts, &mut n, total, stream))?;
            } else {
                check(self.names[5], (self.d_temp)(chunks, chunk_bytes, self.d_opts, &mut n, total, stream))?;
            }
        }
        Ok(n)
    }

    /// # Safety
    /// As for [`Api::compress`].
    unsafe fn compress(&self, a: &Launch) -> Result<(), GpuError> {
        // SAFETY: the caller's contract: every pointer is a device
        // allocation of the sizes nvCOMP requires, at its alignments.
        check(self.names[4], unsafe {
            (self.compress)(
                a.src_ptrs as *const *const c_void,
                a.src_bytes as *const usize,
                a.chunk_bytes,
                a.chunks,
                a.temp as *mut c_void,
                a.temp_bytes,
                a.dst_ptrs as *const *mut c_void,
                a.dst_bytes as *mut usize,
                self.c_opts,
                a.statuses as *mut Status,
                a.stream,
            )
        })
    }

    /// # Safety
    /// As for [`Api::decompress`].
    unsafe fn decompress(&self, a: &Launch) -> Result<(), GpuError> {
        // SAFETY: the caller's contract, as above.
        check(self.names[6], unsafe {
            (self.decompress)(
                a.src_ptrs as *const *const c_void,
                a.src_bytes as *const usize,
                a.dst_capacity as *const usize,
                a.dst_bytes as *mut usize,
                a.chunks,
                a.temp as *mut c_void,
                a.temp_bytes,
                a.dst_ptrs as *const *mut c_void,
                self.d_opts,
                a.statuses as *mut Status,
                a.stream,
            )
        })
    }
}

/// The device arrays of one batched call, all device pointers
/// (`CUdeviceptr`), each array `chunks` long.
pub(crate) struct Launch {
    /// `const void*[]`: the input chunks.
    pub src_ptrs: sys::CUdeviceptr,
    /// `size_t[]`: the input chunks' sizes.
    pub src_bytes: sys::CUdeviceptr,
    /// `void*[]`: the output buffers.
    pub dst_ptrs: sys::CUdeviceptr,
    /// `size_t[]`: the output buffers' sizes (decompression only).
    pub dst_capacity: sys::CUdeviceptr,
    /// `size_t[]`, written: the output chunks' sizes.
    pub dst_bytes: sys::CUdeviceptr,
    /// `nvcompStatus_t[]`, written.
    pub statuses: sys::CUdeviceptr,
    /// The temporary buffer and its size.
    pub temp: sys::CUdeviceptr,
    /// Its size in bytes.
    pub temp_bytes: usize,
    /// How many chunks.
    pub chunks: usize,
    /// The uncompressed size of each chunk (all equal here).
    pub chunk_bytes: usize,
    /// The stream the call is queued on.
    pub stream: sys::CUstream,
}

/// LZ4's or zstd's functions.
pub(crate) enum Api {
    Lz4(Fns<ffi::Lz4CompressOpts, ffi::Lz4DecompressOpts>),
    Zstd(Fns<ffi::ZstdCompressOpts, ffi::ZstdDecompressOpts>),
}

macro_rules! dispatch {
    ($api:expr, $f:ident => $body:expr) => {
        match $api {
            Api::Lz4($f) => $body,
            Api::Zstd($f) => $body,
        }
    };
}

impl Api {
    /// The name of the compress (`true`) or decompress call, for errors.
    pub fn call_name(&self, compress: bool) -> &'static str {
        dispatch!(self, f => f.names[if compress { 4 } else { 6 }])
    }

    /// (compression, decompression) alignment requirements.
    pub fn alignments(&self) -> Result<(AlignmentRequirements, AlignmentRequirements), GpuError> {
        dispatch!(self, f => f.alignments())
    }

    /// The bound on a compressed chunk of `chunk_bytes`.
    pub fn max_compressed_chunk_bytes(&self, chunk_bytes: usize) -> Result<usize, GpuError> {
        dispatch!(self, f => f.max_compressed_chunk_bytes(chunk_bytes))
    }

    /// Temporary bytes for `chunks` chunks of `chunk_bytes` (compression
    /// when `compress`, else decompression).
    ///
    /// # Safety
    /// `stream` is null or a live stream of the current context.
    pub unsafe fn temp_bytes(
        &self,
        compress: bool,
        chunks: usize,
        chunk_bytes: usize,
        stream: sys::CUstream,
    ) -> Result<usize, GpuError> {
        // SAFETY: forwarded contract.
        dispatch!(self, f => unsafe { f.temp_bytes(compress, chunks, chunk_bytes, stream) })
    }

    /// Queues a batched compression; `dst_capacity` is unused.
    ///
    /// # Safety
    /// The current context owns every pointer of `a` and `a.stream`;
    /// `src_ptrs` holds `chunks` pointers to chunks of `src_bytes[i] <=
    /// chunk_bytes` bytes, `dst_ptrs` as many pointers to buffers of the
    /// codec's max compressed chunk size, all at nvCOMP's alignments;
    /// `temp` has `temp_bytes` ≥ the codec's temp size for this batch. The
    /// buffers stay allocated until the stream has run the call.
    pub unsafe fn compress(&self, a: &Launch) -> Result<(), GpuError> {
        // SAFETY: forwarded contract.
        dispatch!(self, f => unsafe { f.compress(a) })
    }

    /// Queues a batched decompression.
    ///
    /// # Safety
    /// As for [`Api::compress`], with `src_ptrs` the compressed chunks
    /// (`src_bytes` long), `dst_ptrs` buffers of `dst_capacity[i]` bytes,
    /// and `dst_bytes` written with the decompressed sizes.
    pub unsafe fn decompress(&self, a: &Launch) -> Result<(), GpuError> {
        // SAFETY: forwarded contract.
        dispatch!(self, f => unsafe { f.decompress(a) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The temp-size calls (options by value between `size_t`s, then a
    /// stream) answer without a GPU for LZ4 and for zstd's decompression
    /// (zstd's compression asks the device). Runs where nvCOMP 6 loads,
    /// e.g. with `TSUBAME_NVCOMP`.
    #[test]
    fn temp_sizes_answer_without_a_gpu() {
        let n = match Nvcomp::load() {
            Ok(n) if n.version.is_some_and(|v| v / 1000 == API_MAJOR) => n,
            _ => return tsubame_testkit::skip("no nvCOMP 6 (set TSUBAME_NVCOMP)"),
        };
        let (lz4, zstd) = (n.api(NvcompAlgo::Lz4).unwrap(), n.api(NvcompAlgo::Zstd).unwrap());
        let null = std::ptr::null_mut();
        // SAFETY: a null stream (the legacy default stream); these calls
        // enqueue nothing.
        let (c, d, z) = unsafe {
            (
                lz4.temp_bytes(true, 1024, 4096, null).unwrap(),
                lz4.temp_bytes(false, 1024, 4096, null).unwrap(),
                zstd.temp_bytes(false, 1024, 4096, null).unwrap(),
            )
        };
        println!("temp bytes for 1024 chunks of 4096: lz4 compress {c}, decompress {d}; zstd decompress {z}");
        assert!(c > 0 && z > 0);
        // SAFETY: as above.
        let half = unsafe { lz4.temp_bytes(true, 512, 4096, null).unwrap() };
        assert!(half <= c, "{half} > {c}");
    }
}

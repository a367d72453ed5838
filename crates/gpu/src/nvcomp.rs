//! nvCOMP's batched LZ4 and zstd (the well-kept GPU baseline), loaded at
//! run time from `libnvcomp.so` (`$TSUBAME_NVCOMP`, the loader's path, or
//! the PyPI wheels `nvidia-nvcomp-cu12`/`-cu13` under site-packages).
//!
//! Only loading and symbol lookup are implemented and tested here; the
//! batched compress/decompress calls need a GPU and are listed in
//! docs/gpu.md as still to be written and measured.

use std::path::PathBuf;

use libloading::Library;

use crate::GpuError;

/// The nvCOMP batched C API functions the baseline needs.
pub const SYMBOLS: [&str; 6] = [
    "nvcompBatchedLZ4CompressGetTempSize",
    "nvcompBatchedLZ4CompressGetMaxOutputChunkSize",
    "nvcompBatchedLZ4CompressAsync",
    "nvcompBatchedLZ4DecompressAsync",
    "nvcompBatchedZstdCompressAsync",
    "nvcompBatchedZstdDecompressAsync",
];

/// Where libnvcomp is looked for.
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("TSUBAME_NVCOMP") {
        out.push(PathBuf::from(p));
    }
    out.push("libnvcomp.so".into());
    out.push("libnvcomp.so.4".into());
    out.push("libnvcomp.so.5".into());
    if let Some(home) = std::env::var_os("HOME") {
        if let Ok(versions) = std::fs::read_dir(PathBuf::from(home).join(".pyenv/versions")) {
            for v in versions.flatten() {
                if let Ok(libs) = std::fs::read_dir(v.path().join("lib")) {
                    for py in libs.flatten() {
                        for sub in ["nvidia/nvcomp", "nvidia/nvcomp/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"] {
                            out.push(py.path().join("site-packages").join(sub).join("libnvcomp.so"));
                        }
                    }
                }
            }
        }
    }
    out
}

/// A loaded libnvcomp, with every function of [`SYMBOLS`] present.
pub struct Nvcomp {
    _lib: Library,
    /// The file it came from.
    pub path: PathBuf,
    /// Which of [`SYMBOLS`] it has.
    pub has: Vec<&'static str>,
}

impl Nvcomp {
    /// Loads libnvcomp; `NvcompMissing` with the places tried when absent.
    pub fn load() -> Result<Nvcomp, GpuError> {
        for path in candidates() {
            if path.is_absolute() && !path.exists() {
                continue;
            }
            // SAFETY: loading libnvcomp runs its initializers (it links
            // the CUDA runtime statically); no symbol is called here.
            let Ok(lib) = (unsafe { Library::new(&path) }) else { continue };
            let has = SYMBOLS
                .iter()
                .copied()
                // SAFETY: only the symbol's presence is checked; it is not
                // called.
                .filter(|s| unsafe { lib.get::<*const ()>(format!("{s}\0").as_bytes()) }.is_ok())
                .collect();
            return Ok(Nvcomp { _lib: lib, path, has });
        }
        Err(GpuError::NvcompMissing(
            "libnvcomp.so not found (set TSUBAME_NVCOMP or pip install nvidia-nvcomp-cu12)".into(),
        ))
    }
}

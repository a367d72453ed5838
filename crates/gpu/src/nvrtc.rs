//! NVRTC, loaded at run time: compiles the CUDA C kernels to PTX. Needs no
//! GPU and no driver, only libnvrtc (the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12` carries it).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

use libloading::Library;

use crate::GpuError;

type Program = *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;

/// Where libnvrtc is looked for, in order: `$TSUBAME_NVRTC` (a file), the
/// loader's search path (LD_LIBRARY_PATH, ldconfig), `$CUDA_HOME/lib64`,
/// `/usr/local/cuda/lib64`, and the `nvidia/cuda_nvrtc/lib` directory of
/// every Python site-packages found next to the usual interpreters.
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("TSUBAME_NVRTC") {
        out.push(PathBuf::from(p));
    }
    for name in ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"] {
        out.push(PathBuf::from(name));
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(h).join("lib64"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    for root in python_site_packages() {
        dirs.push(root.join("nvidia/cuda_nvrtc/lib"));
        dirs.push(root.join("nvidia/cu13/lib"));
    }
    for d in dirs {
        for name in ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"] {
            let p = d.join(name);
            if p.exists() {
                out.push(p);
            }
        }
    }
    out
}

/// site-packages directories under the usual Python prefixes (no Python is
/// run: the directories are listed).
pub(crate) fn python_site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = vec!["/usr/lib".into(), "/usr/local/lib".into()];
    if let Some(home) = std::env::var_os("HOME") {
        let home = PathBuf::from(home);
        roots.push(home.join(".local/lib"));
        if let Ok(versions) = std::fs::read_dir(home.join(".pyenv/versions")) {
            roots.extend(versions.flatten().map(|v| v.path().join("lib")));
        }
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else { continue };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("python3") {
                for sub in ["site-packages", "dist-packages"] {
                    let p = e.path().join(sub);
                    if p.is_dir() {
                        out.push(p);
                    }
                }
            }
        }
    }
    out
}

/// A loaded libnvrtc.
pub struct Nvrtc {
    lib: Library,
    /// The file it came from.
    pub path: PathBuf,
}

impl Nvrtc {
    /// Loads the first candidate that loads; `NoNvrtc` when none does.
    pub fn load() -> Result<Nvrtc, GpuError> {
        for path in candidates() {
            // SAFETY: loading libnvrtc runs its initializers, which have no
            // preconditions; we call only its documented C API below.
            if let Ok(lib) = unsafe { Library::new(&path) } {
                return Ok(Nvrtc { lib, path });
            }
        }
        Err(GpuError::NoNvrtc)
    }

    /// NVRTC's version (major, minor).
    pub fn version(&self) -> Option<(i32, i32)> {
        // SAFETY: nvrtcVersion(int*, int*) has this signature in every
        // NVRTC release.
        let f =
            unsafe { self.lib.get::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>(b"nvrtcVersion\0") }.ok()?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are valid for one int each.
        (unsafe { f(&mut major, &mut minor) } == 0).then_some((major, minor))
    }

    /// Compiles `source` to PTX for `arch` (e.g. `compute_90`).
    pub fn compile(&self, source: &str, name: &str, arch: &str) -> Result<String, GpuError> {
        let sym =
            |s: &'static [u8]| GpuError::Compile { log: format!("libnvrtc lacks {}", String::from_utf8_lossy(s)) };
        // SAFETY: the symbols have these signatures in NVRTC 11 and later
        // (nvrtc.h); the function pointers do not outlive `self.lib`.
        let (create, compile, log_size, log, ptx_size, ptx, destroy) = unsafe {
            (
                *self.lib.get::<CreateFn>(b"nvrtcCreateProgram\0").map_err(|_| sym(b"nvrtcCreateProgram"))?,
                *self.lib.get::<CompileFn>(b"nvrtcCompileProgram\0").map_err(|_| sym(b"nvrtcCompileProgram"))?,
                *self.lib.get::<SizeFn>(b"nvrtcGetProgramLogSize\0").map_err(|_| sym(b"nvrtcGetProgramLogSize"))?,
                *self.lib.get::<GetFn>(b"nvrtcGetProgramLog\0").map_err(|_| sym(b"nvrtcGetProgramLog"))?,
                *self.lib.get::<SizeFn>(b"nvrtcGetPTXSize\0").map_err(|_| sym(b"nvrtcGetPTXSize"))?,
                *self.lib.get::<GetFn>(b"nvrtcGetPTX\0").map_err(|_| sym(b"nvrtcGetPTX"))?,
                *self.lib.get::<DestroyFn>(b"nvrtcDestroyProgram\0").map_err(|_| sym(b"nvrtcDestroyProgram"))?,
            )
        };
        let c = |s: &str| CString::new(s).map_err(|_| GpuError::Compile { log: "NUL in source".into() });
        let (src, cname) = (c(source)?, c(name)?);
        let opts = [c(&format!("--gpu-architecture={arch}"))?, c("--std=c++14")?, c("-default-device")?];
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: `prog` is a valid out-pointer; the strings are
        // NUL-terminated and live across the call; no headers (0, null).
        let rc = unsafe { create(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()) };
        if rc != 0 {
            return Err(GpuError::Compile { log: format!("nvrtcCreateProgram returned {rc}") });
        }
        // SAFETY: `prog` was created above; the options array holds
        // `opt_ptrs.len()` NUL-terminated strings alive across the call.
        let rc = unsafe { compile(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let read = |size: SizeFn, get: GetFn| -> String {
            let mut n = 0usize;
            // SAFETY: `prog` is live; `n` is a valid out-pointer.
            if unsafe { size(prog, &mut n) } != 0 || n == 0 {
                return String::new();
            }
            let mut buf = vec![0u8; n];
            // SAFETY: `buf` holds the `n` bytes NVRTC said it would write.
            if unsafe { get(prog, buf.as_mut_ptr().cast()) } != 0 {
                return String::new();
            }
            CStr::from_bytes_until_nul(&buf).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
        };
        let result =
            if rc != 0 { Err(GpuError::Compile { log: read(log_size, log) }) } else { Ok(read(ptx_size, ptx)) };
        // SAFETY: `prog` was created above and is destroyed once.
        unsafe { destroy(&mut prog) };
        result
    }
}

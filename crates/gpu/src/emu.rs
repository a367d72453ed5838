//! The kernels run on the host, one thread at a time (kernels/emu.cpp).
//! Slow, but it runs the very CUDA C sources the GPU runs, so tests check
//! their output byte for byte against the CPU codecs on any machine. It
//! cannot show races or GPU-only faults (alignment, memory model): those
//! wait for a device.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::{c_char, c_int, c_uint, c_void, CString};

use crate::backend::{Arg, Backend, DevPtr, Packed};
use crate::GpuError;

#[cfg(not(gpu_emulator_missing))]
extern "C" {
    fn tsubame_emu_launch(name: *const c_char, grid: c_uint, block: c_uint, params: *mut *mut c_void) -> c_int;
    fn tsubame_emu_kernel_count() -> c_uint;
    fn tsubame_emu_kernel_name(i: c_uint) -> *const c_char;
}

/// Built without a C++ compiler (see build.rs): no kernels, every launch
/// fails. [`available`] says so before anything is launched.
#[cfg(gpu_emulator_missing)]
mod missing {
    use std::ffi::{c_char, c_int, c_uint, c_void};

    pub unsafe fn tsubame_emu_launch(_: *const c_char, _: c_uint, _: c_uint, _: *mut *mut c_void) -> c_int {
        -1
    }
    pub unsafe fn tsubame_emu_kernel_count() -> c_uint {
        0
    }
    pub unsafe fn tsubame_emu_kernel_name(_: c_uint) -> *const c_char {
        c"".as_ptr()
    }
}
#[cfg(gpu_emulator_missing)]
use missing::*;

/// True when the emulator was built (a C++ compiler was there at build
/// time).
pub fn available() -> bool {
    !cfg!(gpu_emulator_missing)
}

/// The kernel names the emulator has trampolines for.
pub fn kernel_names() -> Vec<String> {
    // SAFETY: both functions only read a static table; `i` is below the
    // count, and the names are static NUL-terminated strings.
    unsafe {
        (0..tsubame_emu_kernel_count())
            .map(|i| std::ffi::CStr::from_ptr(tsubame_emu_kernel_name(i)).to_string_lossy().into_owned())
            .collect()
    }
}

/// Host memory standing in for device memory, one lane.
pub struct Emulator {
    blocks: Vec<(*mut u8, Layout)>,
    staging: Vec<Vec<u8>>,
}

// SAFETY: the raw allocations are owned by the Emulator alone and only
// touched through &mut self (or &self for reads of `staging`).
unsafe impl Send for Emulator {}

impl Emulator {
    /// An emulator with `lanes` lanes (they run in order anyway).
    pub fn new(lanes: usize) -> Emulator {
        Emulator { blocks: Vec::new(), staging: vec![Vec::new(); lanes.max(1)] }
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        for &(p, layout) in &self.blocks {
            // SAFETY: `p` came from alloc_zeroed with this layout and is
            // freed once.
            unsafe { dealloc(p, layout) };
        }
    }
}

impl Backend for Emulator {
    fn lanes(&self) -> usize {
        self.staging.len()
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr, GpuError> {
        let layout = Layout::from_size_align(bytes.max(1), 16).map_err(|e| GpuError::BadBatch(e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        if p.is_null() {
            return Err(GpuError::BadBatch(format!("emulator: out of memory for {bytes} bytes")));
        }
        self.blocks.push((p, layout));
        Ok(p as DevPtr)
    }

    fn upload(&mut self, _lane: usize, dst: DevPtr, src: &[u8]) -> Result<(), GpuError> {
        // SAFETY: `dst` is inside one of our allocations with room for
        // `src` (the encoder sizes its buffers for its largest batch).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&mut self, lane: usize, src: DevPtr, len: usize) -> Result<usize, GpuError> {
        let st = &mut self.staging[lane];
        let at = st.len();
        // SAFETY: `src..src+len` lies inside one of our allocations (the
        // encoder asks only for bytes of its own buffers).
        st.extend_from_slice(unsafe { std::slice::from_raw_parts(src as *const u8, len) });
        // Downloads start 64-byte aligned, as on the GPU's staging: a
        // caller that assumed them back to back failed only there.
        st.resize(st.len().next_multiple_of(64), 0);
        Ok(at)
    }

    fn launch(
        &mut self,
        _lane: usize,
        name: &'static str,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        let cname = CString::new(name).map_err(|_| GpuError::UnknownKernel(name))?;
        let mut packed = Packed::new(args);
        let mut ptrs = packed.pointers();
        // SAFETY: the trampoline reads exactly the arguments the kernel
        // declares, which the encoder passes in order; pointer arguments
        // are addresses of our allocations.
        let rc = unsafe { tsubame_emu_launch(cname.as_ptr(), grid, block, ptrs.as_mut_ptr()) };
        if rc != 0 {
            return Err(GpuError::UnknownKernel(name));
        }
        Ok(())
    }

    fn order(&mut self, _lane: usize, _after: usize) -> Result<(), GpuError> {
        Ok(())
    }

    fn wait(&mut self, _lane: usize) -> Result<(), GpuError> {
        Ok(())
    }

    fn staged(&self, lane: usize, at: usize, len: usize) -> &[u8] {
        &self.staging[lane][at..at + len]
    }

    fn reset_staging(&mut self, lane: usize) {
        self.staging[lane].clear();
    }
}

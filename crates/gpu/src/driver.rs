//! The CUDA driver's presence and its calls' results, shared by our
//! kernels' backend, nvCOMP's batches and the profiler.

use cudarc::driver::sys;

use crate::GpuError;

/// True when libcuda can be loaded (probed before any cudarc call, which
/// would panic without it).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names.
    unsafe { sys::is_culib_present() }
}

/// A CUDA driver call's result as a `Result` (`GpuError::Driver` names it).
pub(crate) fn check(call: &'static str, rc: sys::CUresult) -> Result<(), GpuError> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver { call, code: format!("{rc:?}") })
    }
}

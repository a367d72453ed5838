//! Where a GPU batch's time goes: each kernel and copy timed on the device
//! with CUDA events (`CudaOptions::profile`), and the host's own time in
//! the staging copies and in waiting. For gpu_bench; off by default, as
//! two events per launch cost a little.

use std::collections::BTreeMap;
use std::time::Duration;

use cudarc::driver::sys;

use crate::driver::check;
use crate::GpuError;

/// Device time per kernel or copy, and the host's time.
#[derive(Debug, Default, Clone)]
pub struct Profile {
    /// Name → (calls, seconds on the device).
    pub device: BTreeMap<&'static str, (u64, f64)>,
    /// Host time copying pages into pinned staging.
    pub host_staging: Duration,
    /// Host time in `wait` (spinning, sleeping or blocked).
    pub host_waiting: Duration,
}

impl Profile {
    /// Device seconds of the kernels alone (copies left out).
    pub fn kernel_seconds(&self) -> f64 {
        self.device.iter().filter(|(name, _)| !name.starts_with("copy")).map(|(_, (_, s))| s).sum()
    }

    /// Device seconds of the copies.
    pub fn copy_seconds(&self) -> f64 {
        self.device.iter().filter(|(name, _)| name.starts_with("copy")).map(|(_, (_, s))| s).sum()
    }

    /// One JSON object (no serde in this crate).
    pub fn to_json(&self) -> String {
        let device: Vec<String> = self
            .device
            .iter()
            .map(|(name, (calls, s))| format!("\"{name}\":{{\"calls\":{calls},\"ms\":{:.3}}}", s * 1e3))
            .collect();
        format!(
            "{{\"device\":{{{}}},\"kernel_ms\":{:.3},\"copy_ms\":{:.3},\"host_staging_ms\":{:.3},\"host_waiting_ms\":{:.3}}}",
            device.join(","),
            self.kernel_seconds() * 1e3,
            self.copy_seconds() * 1e3,
            self.host_staging.as_secs_f64() * 1e3,
            self.host_waiting.as_secs_f64() * 1e3
        )
    }
}

/// Timing events around the work queued on each lane, read once it ends.
pub(crate) struct Timer {
    pending: Vec<Vec<(&'static str, sys::CUevent, sys::CUevent)>>,
    free: Vec<sys::CUevent>,
    pub(crate) profile: Profile,
}

impl Timer {
    pub(crate) fn new(lanes: usize) -> Timer {
        Timer { pending: (0..lanes).map(|_| Vec::new()).collect(), free: Vec::new(), profile: Profile::default() }
    }

    fn event(&mut self) -> Result<sys::CUevent, GpuError> {
        if let Some(e) = self.free.pop() {
            return Ok(e);
        }
        let mut e = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flags 0 keep timing on.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, 0) })?;
        Ok(e)
    }

    /// Records an event on `stream` before the work named `name`; the
    /// returned pair is closed by [`Timer::end`] after it.
    pub(crate) fn start(&mut self, stream: sys::CUstream) -> Result<sys::CUevent, GpuError> {
        let e = self.event()?;
        // SAFETY: a live event and stream of the current context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, stream) })?;
        Ok(e)
    }

    pub(crate) fn end(
        &mut self,
        lane: usize,
        stream: sys::CUstream,
        name: &'static str,
        start: sys::CUevent,
    ) -> Result<(), GpuError> {
        let e = self.event()?;
        // SAFETY: a live event and stream of the current context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, stream) })?;
        self.pending[lane].push((name, start, e));
        Ok(())
    }

    /// Reads the lane's timings; its work has ended (after `wait`).
    pub(crate) fn collect(&mut self, lane: usize) -> Result<(), GpuError> {
        for (name, start, end) in std::mem::take(&mut self.pending[lane]) {
            let mut ms = 0f32;
            // SAFETY: both events were recorded on the lane's stream and
            // have completed (the caller waited for the stream's work).
            check("cuEventElapsedTime", unsafe { sys::cuEventElapsedTime(&mut ms, start, end) })?;
            let entry = self.profile.device.entry(name).or_default();
            entry.0 += 1;
            entry.1 += f64::from(ms) / 1e3;
            self.free.extend([start, end]);
        }
        Ok(())
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        let pending = self.pending.iter().flat_map(|l| l.iter().flat_map(|(_, a, b)| [*a, *b]));
        for e in self.free.iter().copied().chain(pending) {
            // SAFETY: events this timer created, destroyed once.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

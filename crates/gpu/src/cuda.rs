//! A real GPU through the CUDA driver API (cudarc's raw bindings, loaded
//! with dlopen). Each lane is a non-blocking stream with its own pinned
//! staging buffers, so one batch's copies overlap another's kernels.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use crate::backend::{Arg, Backend, DevPtr, Packed};
use crate::driver::check;
pub use crate::driver::driver_present;
use crate::profile::{Profile, Timer};
use crate::wait::{SleepMin, WaitPolicy};
use crate::{kernels, GpuError};

/// How to open the GPU.
#[derive(Debug, Clone, Copy)]
pub struct CudaOptions {
    /// Device ordinal.
    pub device: i32,
    /// Streams (2: a batch's copies overlap the previous one's kernels).
    pub lanes: usize,
    /// Largest batch, in pages (sizes the pinned staging buffers).
    pub max_pages: usize,
    /// How the host waits.
    pub wait: WaitPolicy,
    /// Time every kernel and copy on the device ([`Cuda::profile`]).
    pub profile: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            lanes: 2,
            max_pages: crate::DEFAULT_BATCH_PAGES,
            wait: WaitPolicy::default(),
            profile: false,
        }
    }
}

struct Lane {
    stream: sys::CUstream,
    done: sys::CUevent,
    blocking: sys::CUevent,
    order: sys::CUevent,
    input: *mut u8,
    input_used: usize,
    output: *mut u8,
    output_used: usize,
    capacity: usize,
    started: Option<Instant>,
}

/// The GPU.
pub struct Cuda {
    name: String,
    functions: HashMap<&'static str, sys::CUfunction>,
    lanes: Vec<Lane>,
    allocations: Vec<sys::CUdeviceptr>,
    policy: WaitPolicy,
    sleep_min: SleepMin,
    /// When the host last saw a lane's work end: a batch queued behind
    /// another lane's starts on the device no earlier.
    last_done: Option<Instant>,
    timer: Option<Timer>,
    _module: sys::CUmodule,
}

// SAFETY: the CUDA handles are used by one thread at a time (&mut self);
// the primary context is made current in every call that needs it.
unsafe impl Send for Cuda {}

impl Cuda {
    /// Opens device `options.device`, compiles the kernels with NVRTC for
    /// it and sets up the lanes. "no CUDA driver found" when there is no
    /// libcuda; never panics for a missing library.
    pub fn open(options: CudaOptions) -> Result<Cuda, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        // SAFETY: libcuda is present (checked above), so cudarc's loader
        // does not panic; every out-pointer is a valid local.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
            if count <= options.device {
                return Err(GpuError::NoDevice);
            }
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, options.device))?;
            let mut ctx = std::ptr::null_mut();
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            let mut name = [0 as std::ffi::c_char; 128];
            check("cuDeviceGetName", sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev))?;
            let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let (mut major, mut minor) = (0, 0);
            use sys::CUdevice_attribute::*;
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(&mut major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
            )?;
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(&mut minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
            )?;
            let ptx = crate::nvrtc::Nvrtc::load()?.compile(
                &kernels::source(),
                "tsubame.cu",
                &format!("compute_{major}{minor}"),
            )?;
            let ptx = CString::new(ptx).map_err(|_| GpuError::Compile { log: "NUL in PTX".into() })?;
            let mut module = std::ptr::null_mut();
            check("cuModuleLoadData", sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()))?;
            let mut functions = HashMap::new();
            for k in kernels::KERNELS {
                let mut f = std::ptr::null_mut();
                let cname = CString::new(k).expect("kernel names have no NUL");
                check("cuModuleGetFunction", sys::cuModuleGetFunction(&mut f, module, cname.as_ptr()))?;
                functions.insert(k, f);
            }
            let capacity = options.max_pages.max(1) * (tsubame_codec::PAGE_SIZE + 64) + 4096;
            let mut lanes = Vec::new();
            for _ in 0..options.lanes.max(1) {
                let mut stream = std::ptr::null_mut();
                check("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1))?; // CU_STREAM_NON_BLOCKING
                let mut ev = [std::ptr::null_mut(); 3];
                check("cuEventCreate", sys::cuEventCreate(&mut ev[0], 2))?; // DISABLE_TIMING
                check("cuEventCreate", sys::cuEventCreate(&mut ev[1], 1 | 2))?; // BLOCKING_SYNC
                check("cuEventCreate", sys::cuEventCreate(&mut ev[2], 2))?;
                let (mut input, mut output) = (std::ptr::null_mut(), std::ptr::null_mut());
                check("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut input, capacity))?;
                check("cuMemAllocHost", sys::cuMemAllocHost_v2(&mut output, capacity))?;
                lanes.push(Lane {
                    stream,
                    done: ev[0],
                    blocking: ev[1],
                    order: ev[2],
                    input: input.cast(),
                    input_used: 0,
                    output: output.cast(),
                    output_used: 0,
                    capacity,
                    started: None,
                });
            }
            Ok(Cuda {
                name,
                functions,
                lanes,
                allocations: Vec::new(),
                policy: options.wait,
                sleep_min: SleepMin::default(),
                last_done: None,
                timer: options.profile.then(|| Timer::new(options.lanes.max(1))),
                _module: module,
            })
        }
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The wait policy.
    pub fn policy(&self) -> WaitPolicy {
        self.policy
    }

    /// Where the time went so far, when opened with `profile`.
    pub fn profile(&self) -> Option<&Profile> {
        self.timer.as_ref().map(|t| &t.profile)
    }

    /// Starts timing work about to be queued on `lane` (with `profile`).
    fn time_start(&mut self, lane: usize) -> Result<Option<sys::CUevent>, GpuError> {
        let stream = self.lanes[lane].stream;
        self.timer.as_mut().map(|t| t.start(stream)).transpose()
    }

    fn time_end(&mut self, lane: usize, name: &'static str, start: Option<sys::CUevent>) -> Result<(), GpuError> {
        let stream = self.lanes[lane].stream;
        match (self.timer.as_mut(), start) {
            (Some(t), Some(start)) => t.end(lane, stream, name, start),
            _ => Ok(()),
        }
    }

    /// Waits for everything queued on `lane`, per the wait policy.
    fn wait_for(&mut self, lane: usize) -> Result<(), GpuError> {
        let result = self.wait_per_policy(lane);
        self.last_done = Some(Instant::now());
        result
    }

    fn wait_per_policy(&mut self, lane: usize) -> Result<(), GpuError> {
        let policy = self.policy;
        let l = &mut self.lanes[lane];
        // sleep-min's clock starts when the batch could start on the
        // device: its submission, or the end of the batch it queued
        // behind. From the submission alone, a batch behind another lane's
        // had used up the shortest time before its wait began, and
        // sleep-min never slept (the H200 runs: as much CPU as spin).
        let started = l.started.take().map(|t| self.last_done.map_or(t, |d| t.max(d)));
        let event = if policy == WaitPolicy::Blocking { l.blocking } else { l.done };
        // SAFETY: live event and stream.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event, l.stream) })?;
        match policy {
            WaitPolicy::Spin => Cuda::spin(event),
            // SAFETY: a live event created with CU_EVENT_BLOCKING_SYNC.
            WaitPolicy::Blocking => check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event) }),
            WaitPolicy::SleepMin => {
                let Some(t0) = started else { return Cuda::spin(event) };
                match self.sleep_min.sleep_for(t0.elapsed()) {
                    None => {
                        Cuda::spin(event)?;
                        self.sleep_min.record(t0.elapsed());
                        Ok(())
                    }
                    Some(d) => {
                        if d > Duration::ZERO {
                            std::thread::sleep(d);
                        }
                        // SAFETY: a live event.
                        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event) })
                    }
                }
            }
        }
    }

    fn spin(event: sys::CUevent) -> Result<(), GpuError> {
        loop {
            // SAFETY: `event` is a live event of this context.
            match unsafe { sys::cuEventQuery(event) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
                rc => return check("cuEventQuery", rc),
            }
        }
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        // SAFETY: every handle was created by this object and is released
        // once; errors at teardown are ignored.
        unsafe {
            for l in &self.lanes {
                sys::cuStreamSynchronize(l.stream);
                sys::cuMemFreeHost(l.input.cast());
                sys::cuMemFreeHost(l.output.cast());
                sys::cuEventDestroy_v2(l.done);
                sys::cuEventDestroy_v2(l.blocking);
                sys::cuEventDestroy_v2(l.order);
                sys::cuStreamDestroy_v2(l.stream);
            }
            for &p in &self.allocations {
                sys::cuMemFree_v2(p);
            }
        }
    }
}

impl Backend for Cuda {
    fn lanes(&self) -> usize {
        self.lanes.len()
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr, GpuError> {
        let mut p = 0;
        // SAFETY: `p` is a valid out-pointer; the memset covers exactly the
        // allocation.
        unsafe {
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut p, bytes.max(1)))?;
            self.allocations.push(p);
            check("cuMemsetD8", sys::cuMemsetD8_v2(p, 0, bytes.max(1)))?;
            // The memset may still run on the legacy stream when this
            // returns, and the lanes' non-blocking streams do not wait for
            // it: a fill kernel queued next could run first.
            check("cuStreamSynchronize", sys::cuStreamSynchronize(std::ptr::null_mut()))?;
        }
        Ok(p)
    }

    fn upload(&mut self, lane: usize, dst: DevPtr, src: &[u8]) -> Result<(), GpuError> {
        if self.lanes[lane].input_used + src.len() > self.lanes[lane].capacity {
            return Err(GpuError::BadBatch(format!("{} bytes exceed the lane's staging", src.len())));
        }
        let copy_started = Instant::now();
        let l = &mut self.lanes[lane];
        l.started.get_or_insert(copy_started);
        let at = l.input_used;
        // SAFETY: the staging buffer has `capacity` bytes (checked above);
        // it is not rewritten before `wait` on this lane (reset_staging is
        // called only for a finished lane), so the async copy reads stable
        // bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), l.input.add(at), src.len()) };
        l.input_used += src.len().next_multiple_of(64);
        if let Some(t) = &mut self.timer {
            t.profile.host_staging += copy_started.elapsed();
        }
        let timed = self.time_start(lane)?;
        let l = &self.lanes[lane];
        // SAFETY: as above: `at..at + len` lies in the pinned input buffer.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, l.input.add(at) as *const c_void, src.len(), l.stream)
        })?;
        self.time_end(lane, "copy to device", timed)
    }

    fn download(&mut self, lane: usize, src: DevPtr, len: usize) -> Result<usize, GpuError> {
        let l = &mut self.lanes[lane];
        if l.output_used + len > l.capacity {
            return Err(GpuError::BadBatch(format!("{len} bytes exceed the lane's staging")));
        }
        let at = l.output_used;
        l.output_used += len.next_multiple_of(64);
        if len > 0 {
            let timed = self.time_start(lane)?;
            let l = &self.lanes[lane];
            // SAFETY: `at + len` is within the pinned output buffer (checked
            // above), which lives as long as `self`.
            check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(l.output.add(at).cast(), src, len, l.stream)
            })?;
            self.time_end(lane, "copy to host", timed)?;
        }
        Ok(at)
    }

    fn launch(&mut self, lane: usize, name: &'static str, grid: u32, block: u32, args: &[Arg]) -> Result<(), GpuError> {
        let f = *self.functions.get(name).ok_or(GpuError::UnknownKernel(name))?;
        let timed = self.time_start(lane)?;
        let mut packed = Packed::new(args);
        let mut ptrs = packed.pointers();
        // SAFETY: `f` is a kernel of our module whose parameters are
        // exactly `args` in order (kernels/*.cu); each pointer in `ptrs`
        // addresses an 8-byte value that lives across the call (the driver
        // copies the parameters at launch).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                self.lanes[lane].stream,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        self.time_end(lane, name, timed)
    }

    fn order(&mut self, lane: usize, after: usize) -> Result<(), GpuError> {
        if lane == after {
            return Ok(());
        }
        let (ev, stream) = (self.lanes[after].order, self.lanes[lane].stream);
        // SAFETY: live event and streams of this context.
        unsafe {
            check("cuEventRecord", sys::cuEventRecord(ev, self.lanes[after].stream))?;
            check("cuStreamWaitEvent", sys::cuStreamWaitEvent(stream, ev, 0))
        }
    }

    fn wait(&mut self, lane: usize) -> Result<(), GpuError> {
        let waiting = Instant::now();
        self.wait_for(lane)?;
        if let Some(t) = &mut self.timer {
            t.profile.host_waiting += waiting.elapsed();
            t.collect(lane)?;
        }
        Ok(())
    }

    fn staged(&self, lane: usize, at: usize, len: usize) -> &[u8] {
        let l = &self.lanes[lane];
        assert!(at + len <= l.capacity);
        // SAFETY: inside the pinned output buffer (asserted); the copies
        // into it completed in `wait`, and `&self` keeps it from being
        // reused while the slice lives.
        unsafe { std::slice::from_raw_parts(l.output.add(at), len) }
    }

    fn reset_staging(&mut self, lane: usize) {
        let l = &mut self.lanes[lane];
        l.input_used = 0;
        l.output_used = 0;
        l.started = None;
    }
}
